//! The text log's field formatter: every field of every event and span (the message too) with
//! its control characters escaped, so that nothing a client sends (a session label, a model
//! name from a URL, an error that quotes a request) can forge a log line with a newline or
//! reach the operator's terminal as an escape sequence. The JSON log needs none of this: JSON
//! strings escape control characters already.

use std::fmt;

use tpubox_core::logsafe::{Clip, LINE_BYTES};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};

/// [`DefaultFields`], with [`escape`] applied to what it writes. Without colours in the fields
/// (field names are not dimmed on a terminal); the level's colour stays.
#[derive(Debug, Default)]
pub struct EscapedFields(DefaultFields);

impl<'w> FormatFields<'w> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut raw = String::new();
        FormatFields::format_fields(&self.0, Writer::new(&mut raw), fields)?;
        // A backstop: client-controlled fields are clipped where they are logged
        // (`tpubox_core::logsafe`); no line's fields exceed LINE_BYTES even where one was not.
        if raw.len() > LINE_BYTES {
            raw = Clip::with_max(&raw, LINE_BYTES).to_string();
        }
        escape(&mut writer, &raw)
    }
}

/// Writes `s` to `out` with every control character (C0, DEL, C1), the Unicode line and
/// paragraph separators and the bidirectional overrides escaped: `\n`, `\r`, `\t`, else
/// `\u{HEX}`. Printable text, other Unicode included, is written as it is.
///
/// Errors: those of `out`.
pub fn escape(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    for c in s.chars() {
        match c {
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            c if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                write!(out, "\\u{{{:x}}}", c as u32)?
            }
            c => out.write_char(c)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        let mut out = String::new();
        escape(&mut out, "a\nb\r\t\x1b[2J\x07\u{9b}\u{2028}\u{202e}é ok").unwrap();
        assert_eq!(
            out,
            "a\\nb\\r\\t\\u{1b}[2J\\u{7}\\u{9b}\\u{2028}\\u{202e}é ok"
        );
    }
}
