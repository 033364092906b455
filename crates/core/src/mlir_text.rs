//! MLIR text without its source locations, so that the same program compiles once.
//!
//! MLIR prints a location after every operation, block argument and region (`loc("x")`,
//! `loc(#loc3)`, `loc("cell.py":12:3)`, `loc(fused[...])`, `loc(callsite(... at ...))`) and
//! defines location aliases on lines of their own (`#loc3 = loc("jit(f)/tanh")`). A notebook
//! cell's file name holds its kernel's process id, so the same cell sent from two kernels, or
//! after a restart, is different text and would miss the compile cache, which is keyed by the
//! program's bytes. Locations never change what a program computes (MLIR's language reference:
//! "Locations" are debug information), so the session layer strips them from programs sent as
//! text before the cache lookup and the compile; the price is that a compile error no longer
//! cites a source line.

use std::borrow::Cow;

/// `text` without location specifiers and location alias definitions. Text without `loc(`
/// comes back borrowed; so does text whose locations do not parse (an unterminated string or
/// parenthesis), which is left for the compiler to report.
///
/// A `loc(` counts only outside string literals and `//` comments and at the start of a token
/// (not inside an identifier such as `myloc(`); the blanks before it on its line go with it.
pub fn strip_locations(text: &str) -> Cow<'_, str> {
    if !text.contains("loc(") {
        return Cow::Borrowed(text);
    }
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let (mut i, mut copied) = (0usize, 0usize);
    while i < b.len() {
        match b[i] {
            b'"' => match skip_string(b, i) {
                Some(end) => i = end,
                None => return Cow::Borrowed(text),
            },
            b'/' if b.get(i + 1) == Some(&b'/') => {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
            }
            b'l' if b[i..].starts_with(b"loc(") && at_token_start(b, i) => {
                let Some(close) = skip_parens(b, i + 3) else {
                    return Cow::Borrowed(text);
                };
                let line_start = b[..i]
                    .iter()
                    .rposition(|&c| c == b'\n')
                    .map_or(0, |p| p + 1);
                let (from, to) = if is_alias_definition(&text[line_start..i]) {
                    // The whole line, and its newline.
                    let to = if b.get(close) == Some(&b'\n') {
                        close + 1
                    } else {
                        close
                    };
                    (line_start, to)
                } else {
                    let blanks = b[line_start..i]
                        .iter()
                        .rev()
                        .take_while(|&&c| c == b' ' || c == b'\t')
                        .count();
                    (i - blanks, close)
                };
                out.push_str(&text[copied..from]);
                copied = to;
                i = to;
            }
            _ => i += 1,
        }
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// Whether the token at `i` starts there (the byte before cannot continue an identifier, a
/// value name, a symbol or an alias).
fn at_token_start(b: &[u8], i: usize) -> bool {
    i == 0
        || !matches!(b[i - 1], b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'$' | b'.' | b'-' | b'#' | b'%' | b'@' | b'!')
}

/// Whether `prefix` (a line up to a `loc(`) is `#name =`: the line defines a location alias.
fn is_alias_definition(prefix: &str) -> bool {
    let Some(rest) = prefix.trim_start().strip_prefix('#') else {
        return false;
    };
    let Some(name) = rest.trim_end().strip_suffix('=') else {
        return false;
    };
    let name = name.trim_end();
    !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.' | b'-'))
}

/// The index just past the string literal opening at `b[start] == b'"'` (backslash escapes
/// skipped), or `None` if it does not end.
fn skip_string(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// The index just past the parenthesis that closes the one at `b[open] == b'('` (strings
/// inside skipped), or `None` if it does not close.
fn skip_parens(b: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i = skip_string(b, i)?;
                continue;
            }
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same function as jax.export prints it from two notebook cells (other file names,
    /// other alias numbering of the same names).
    const CELL_A: &str = r##"#loc1 = loc("x")
module @jit_f attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32> loc("x")) -> (tensor<4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.tanh %arg0 : tensor<4xf32> loc(#loc3)
    %1 = stablehlo.custom_call @foo(%0) {backend_config = "keep loc(this) \"and ( this\""} : (tensor<4xf32>) -> tensor<4xf32> loc(callsite("f"("/tmp/ipykernel_4711/123.py":3:9) at "<module>"("/tmp/ipykernel_4711/123.py":5:0)))
    return %1 : tensor<4xf32> loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc = loc(unknown)
#loc2 = loc("/tmp/ipykernel_4711/123.py":3:9)
#loc3 = loc(fused[#loc2, "jit(f)/tanh"])
"##;

    const CELL_B: &str = r##"#loc9 = loc("x")
module @jit_f attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32> loc("x")) -> (tensor<4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.tanh %arg0 : tensor<4xf32> loc(#loc7)
    %1 = stablehlo.custom_call @foo(%0) {backend_config = "keep loc(this) \"and ( this\""} : (tensor<4xf32>) -> tensor<4xf32> loc("/tmp/ipykernel_99/7.py":1:1)
    return %1 : tensor<4xf32> loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc = loc(unknown)
#loc7 = loc("/tmp/ipykernel_99/7.py":3:9)
"##;

    const STRIPPED: &str = r##"module @jit_f attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.tanh %arg0 : tensor<4xf32>
    %1 = stablehlo.custom_call @foo(%0) {backend_config = "keep loc(this) \"and ( this\""} : (tensor<4xf32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
}
"##;

    #[test]
    fn two_cells_of_one_function_strip_to_the_same_text() {
        assert_eq!(strip_locations(CELL_A), STRIPPED);
        assert_eq!(strip_locations(CELL_B), STRIPPED);
    }

    #[test]
    fn text_without_locations_or_with_broken_ones_comes_back_borrowed() {
        for text in [
            STRIPPED,
            "func.func @main() { // loc( in a comment\n}",
            "%0 = stablehlo.tanh %a loc(\"never closed",
            "%0 = stablehlo.tanh %a loc((#loc1)",
        ] {
            assert!(
                matches!(strip_locations(text), Cow::Borrowed(t) if t == text),
                "{text}"
            );
        }
    }

    #[test]
    fn only_a_loc_at_the_start_of_a_token_is_a_location() {
        let text = "%0 = my.op @myloc(%a) {k = \"loc(\"} : tensor<f32> loc(\"x\")\n";
        assert_eq!(
            strip_locations(text),
            "%0 = my.op @myloc(%a) {k = \"loc(\"} : tensor<f32>\n"
        );
        // A comment keeps what it says; the location after the op goes.
        let text = "%0 = a.b %x loc(#l) // loc(kept)\n";
        assert_eq!(strip_locations(text), "%0 = a.b %x // loc(kept)\n");
    }
}
