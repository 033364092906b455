//! Triton's model configuration schema: every configuration tpubox reads (`config.pbtxt` in
//! protobuf text format, `config.json`, `config.toml`, and a load's config override in protobuf
//! JSON) is first read as Triton's `inference.ModelConfig` message, against Triton's own
//! `model_config.proto` (vendored unchanged in `host/proto/triton/`, compiled by `build.rs`),
//! with `prost-reflect`. So a field Triton does not define, a value of the wrong type or an
//! enum value Triton does not know fails the load with the parser's words and position, and
//! the JSON forms accept what protobuf's JSON parser accepts: the camelCase names
//! (`maxBatchSize`) beside the proto names, and quoted numbers for integer fields (Triton reads
//! its config override that way; `tritonclient`'s model-control example sends
//! `{"max_batch_size":"16"}`).
//!
//! The message is then written back as JSON with the proto names and walked against
//! [`IMPLEMENTED`]: what tpubox implements is kept for [`crate::config::ModelConfig`]'s serde
//! reading, a field in [`REFUSED`] fails the load (it changes what the model computes or
//! accepts, and tpubox cannot honour it), and every other field that is set is dropped and
//! named in [`Normalized::ignored`], which the load logs as a warning.
//!
//! tpubox's own settings (the `tpubox` table of `config.toml`) are not part of Triton's message:
//! they are taken out before the message is read, and put back after.

use std::sync::OnceLock;

use anyhow::{Result, bail};
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions,
};
use serde_json::{Map, Value};

use super::protocol::Datatype;

/// The descriptor set `build.rs` compiled from `host/proto/triton/model_config.proto`.
static MODEL_CONFIG_FDS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/model_config.fds"));

/// Triton's `inference.ModelConfig` message.
fn model_config() -> &'static MessageDescriptor {
    static DESC: OnceLock<MessageDescriptor> = OnceLock::new();
    DESC.get_or_init(|| {
        DescriptorPool::decode(MODEL_CONFIG_FDS)
            .expect("build.rs writes a valid descriptor set")
            .get_message_by_name("inference.ModelConfig")
            .expect("model_config.proto defines inference.ModelConfig")
    })
}

/// The form a configuration is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Protobuf text format (`config.pbtxt`), as Triton reads it.
    Pbtxt,
    /// Protobuf JSON (`config.json`, a load's config override), plus a `tpubox` object.
    Json,
    /// TOML with the proto field names (`config.toml`), plus a `[tpubox]` table.
    Toml,
}

/// A configuration read as Triton's `ModelConfig`.
#[derive(Debug, Clone, Default)]
pub struct Normalized {
    /// The fields tpubox implements, with the proto field names and JSON values (enums by
    /// name, 64-bit integers as numbers); fields at their default value are left out, as
    /// protobuf leaves them out, except `max_batch_size` when the source set it.
    pub triton: Map<String, Value>,
    /// The `tpubox` table, where the source has one (never in `config.pbtxt`).
    pub tpubox: Option<Value>,
    /// The fields that were set and are ignored, by path (`input[data_0].reshape`,
    /// `parameters (execute_delay_ms)`).
    pub ignored: Vec<String>,
}

/// The paths (proto field names, arrays transparent) whose values tpubox implements. A path
/// names the field and everything under it; an object whose path is a prefix of one is walked.
pub const IMPLEMENTED: &[&str] = &[
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "default_model_filename",
    "input.name",
    "input.data_type",
    "input.dims",
    "output.name",
    "output.data_type",
    "output.dims",
    "instance_group.name",
    "instance_group.kind",
    "instance_group.count",
    "instance_group.gpus",
    "dynamic_batching.preferred_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.default_queue_policy.max_queue_size",
    "sequence_batching.max_sequence_idle_microseconds",
    "sequence_batching.control_input",
    "sequence_batching.direct.max_queue_delay_microseconds",
    "sequence_batching.oldest.max_queue_delay_microseconds",
    "model_transaction_policy.decoupled",
];

/// The fields whose setting fails the load, with why: each changes which requests the model
/// accepts or what it computes, so ignoring it would serve wrong answers.
pub const REFUSED: &[(&str, &str)] = &[
    (
        "ensemble_scheduling",
        "tpubox does not run ensembles (compose the steps in one guest, or call the models in turn)",
    ),
    (
        "batch_input",
        "ragged batching's batch inputs are not implemented",
    ),
    (
        "batch_output",
        "ragged batching's batch outputs are not implemented",
    ),
    (
        "input.allow_ragged_batch",
        "ragged batching is not implemented (every request of a batch has the input's shape)",
    ),
    (
        "input.optional",
        "optional inputs are not implemented (every request carries every input)",
    ),
    (
        "input.is_shape_tensor",
        "shape tensors are a TensorRT feature tpubox does not implement",
    ),
    (
        "output.is_shape_tensor",
        "shape tensors are a TensorRT feature tpubox does not implement",
    ),
    (
        "sequence_batching.state",
        "implicit sequence state is not implemented (keep the state in the instance, as a guest does)",
    ),
    (
        "sequence_batching.iterative_sequence",
        "iterative sequences are not implemented",
    ),
];

/// Reads `text`, a configuration in `format`; `what` names it in errors (`config.pbtxt`, `the
/// config override`).
///
/// Errors: text that does not parse in its format (with the line and column for
/// `config.pbtxt`), a field Triton's `ModelConfig` does not define, a value of the wrong type,
/// a JSON or TOML configuration that is not an object, both `dynamic_batching` and
/// `sequence_batching`, a field of [`REFUSED`].
pub fn normalize(text: &str, format: Format, what: &str) -> Result<Normalized> {
    let desc = model_config().clone();
    let (message, tpubox, sets_max_batch) = match format {
        Format::Pbtxt => {
            let text = &colons_before_message_lists(text);
            let m = DynamicMessage::parse_text_format(desc, text).map_err(|e| {
                let at = text_position(text, &e);
                anyhow::anyhow!("{what}{at}: {e} (Triton's ModelConfig in protobuf text format)")
            })?;
            (m, None, false)
        }
        Format::Json | Format::Toml => {
            let value: Value = match format {
                Format::Json => serde_json::from_str(text)
                    .map_err(|e| anyhow::anyhow!("{what}: not JSON: {e}"))?,
                _ => serde_json::to_value(
                    toml::from_str::<toml::Table>(text)
                        .map_err(|e| anyhow::anyhow!("{what}: {e}"))?,
                )?,
            };
            let Value::Object(mut object) = value else {
                bail!("{what}: the configuration must be an object (Triton's ModelConfig)");
            };
            let tpubox = object.remove("tpubox");
            let sets_max_batch =
                object.contains_key("max_batch_size") || object.contains_key("maxBatchSize");
            let scheduling = ["dynamic_batching", "dynamicBatching"]
                .iter()
                .any(|k| object.contains_key(*k))
                && ["sequence_batching", "sequenceBatching"]
                    .iter()
                    .any(|k| object.contains_key(*k));
            if scheduling {
                bail!(
                    "{what}: dynamic_batching and sequence_batching are exclusive (a stateful model batches through sequence_batching)"
                );
            }
            protocol_datatype_names(&mut object);
            let m = DynamicMessage::deserialize_with_options(
                desc,
                Value::Object(object),
                &DeserializeOptions::new(),
            )
            .map_err(|e| anyhow::anyhow!("{what}: {e} (Triton's ModelConfig)"))?;
            (m, tpubox, sets_max_batch)
        }
    };
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false)
        .skip_default_fields(true);
    let value = message.serialize_with_options(serde_json::value::Serializer, &options)?;
    let Value::Object(mut triton) = value else {
        bail!("{what}: a message serialises as an object");
    };
    if sets_max_batch {
        triton
            .entry("max_batch_size")
            .or_insert_with(|| Value::from(0));
    }
    let mut ignored = Vec::new();
    walk(&mut triton, "", "", &mut ignored).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    Ok(Normalized {
        triton,
        tpubox,
        ignored,
    })
}

/// `text` with a `:` put between a field name and the `[` of a list that follows it
/// directly (`input [ { … } ]`, how every Triton configuration writes its repeated messages).
/// The text format's grammar makes that colon optional before a message list
/// (`MessageField = FieldName, [ ":" ], ( MessageValue | MessageList )`, protobuf's "Text
/// Format Language Specification"); prost-reflect 0.16's parser wants it, so it is added here.
/// Nothing else changes, and positions stay on the same line and column but for the
/// inserted characters: string literals and `#` comments are skipped, and an identifier
/// followed by `[` has no other meaning in a message without extensions (Triton's has none).
fn colons_before_message_lists(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 16);
    let mut i = 0;
    let mut after_ident = false;
    let mut copied = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'"' | b'\'' => {
                // A string literal, escapes included, up to its closing quote or the line's end.
                i += 1;
                while i < bytes.len() && bytes[i] != b && bytes[i] != b'\n' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                after_ident = false;
            }
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b' ' | b'\t' | b'\r' | b'\n' => i += 1,
            b'[' if after_ident => {
                out.push_str(&text[copied..i]);
                out.push(':');
                copied = i;
                after_ident = false;
                i += 1;
            }
            b if b.is_ascii_alphabetic() || b == b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                after_ident = true;
            }
            _ => {
                after_ident = false;
                i += 1;
            }
        }
    }
    out.push_str(&text[copied.min(text.len())..]);
    out
}

/// ` line L, column C` of a text-format error, where the parser gave a position.
fn text_position(text: &str, e: &prost_reflect::text_format::ParseError) -> String {
    use miette::Diagnostic;
    let Some(offset) = e
        .labels()
        .and_then(|mut l| l.next())
        .map(|l| l.offset().min(text.len()))
    else {
        return String::new();
    };
    let before = &text.as_bytes()[..offset];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let column = offset
        - before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |p| p + 1)
        + 1;
    format!(" line {line}, column {column}")
}

/// tpubox's TOML and JSON configurations have always taken the protocol's datatype names
/// (`FP32`) beside Triton's (`TYPE_FP32`): the former are rewritten to the latter before the
/// message is read, in `input`, `output` and the control inputs.
fn protocol_datatype_names(object: &mut Map<String, Value>) {
    fn fix(v: &mut Value) {
        if let Value::String(s) = v
            && !s.starts_with("TYPE_")
            && let Some(d) = Datatype::from_name(s)
        {
            *s = d.config_name().to_string();
        }
    }
    for key in ["input", "output"] {
        if let Some(Value::Array(ts)) = object.get_mut(key) {
            for t in ts {
                if let Some(v) = t.get_mut("data_type") {
                    fix(v);
                }
            }
        }
    }
    let controls = object
        .get_mut("sequence_batching")
        .and_then(|s| s.get_mut("control_input"))
        .and_then(Value::as_array_mut);
    for ci in controls.into_iter().flatten() {
        if let Some(Value::Array(cs)) = ci.get_mut("control") {
            for c in cs {
                if let Some(v) = c.get_mut("data_type") {
                    fix(v);
                }
            }
        }
    }
}

/// Walks `object` (at proto path `path`, shown as `shown`): keeps [`IMPLEMENTED`] fields,
/// fails on [`REFUSED`] ones, drops and records every other one.
fn walk(
    object: &mut Map<String, Value>,
    path: &str,
    shown: &str,
    ignored: &mut Vec<String>,
) -> Result<()> {
    let keys: Vec<String> = object.keys().cloned().collect();
    for key in keys {
        let p = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        let s = if shown.is_empty() {
            key.clone()
        } else {
            format!("{shown}.{key}")
        };
        if IMPLEMENTED.contains(&p.as_str()) {
            continue;
        }
        if let Some((_, why)) = REFUSED.iter().find(|(r, _)| *r == p) {
            bail!("`{s}` is set, and {why}");
        }
        let prefix = format!("{p}.");
        let inner = IMPLEMENTED
            .iter()
            .copied()
            .chain(REFUSED.iter().map(|(r, _)| *r))
            .any(|i| i.starts_with(&prefix));
        match object.get_mut(&key) {
            Some(Value::Object(m)) if inner => walk(m, &p, &s, ignored)?,
            Some(Value::Array(items)) if inner => {
                for (i, item) in items.iter_mut().enumerate() {
                    if let Value::Object(m) = item {
                        let label = match m.get("name").and_then(Value::as_str) {
                            Some(n) => format!("{s}[{n}]"),
                            None => format!("{s}[{i}]"),
                        };
                        walk(m, &p, &label, ignored)?;
                    }
                }
            }
            Some(v) => {
                ignored.push(match v {
                    Value::Object(m) if key == "parameters" || key == "metric_tags" => {
                        format!("{s} ({})", m.keys().cloned().collect::<Vec<_>>().join(", "))
                    }
                    _ => s,
                });
                object.remove(&key);
            }
            None => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pbtxt_reads_as_triton_does() {
        let n = normalize(
            r#"
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "l.txt" } ]
parameters [ { key: "execute_delay_ms" value: { string_value: "3" } } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"#,
            Format::Pbtxt,
            "config.pbtxt",
        )
        .unwrap();
        assert_eq!(
            Value::Object(n.triton),
            json!({
                "name": "densenet_onnx",
                "platform": "onnxruntime_onnx",
                "input": [{"name": "data_0", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}],
                "output": [{"name": "fc6_1", "data_type": "TYPE_FP32", "dims": [1000]}],
                "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
            })
        );
        assert_eq!(
            n.ignored,
            [
                "input[data_0].format",
                "input[data_0].reshape",
                "output[fc6_1].label_filename",
                "parameters (execute_delay_ms)"
            ]
        );
    }

    #[test]
    fn message_lists_may_omit_the_colon() {
        assert_eq!(
            colons_before_message_lists("input [ { name: \"a [\" } ] # x [\nb:[1]\n"),
            "input :[ { name: \"a [\" } ] # x [\nb:[1]\n"
        );
        assert_eq!(
            colons_before_message_lists("k: 'it\\'s' o [ ]"),
            "k: 'it\\'s' o :[ ]"
        );
        assert_eq!(colons_before_message_lists("dims: [ 1 ]"), "dims: [ 1 ]");
    }

    #[test]
    fn pbtxt_errors_name_the_place() {
        let e = normalize(
            "name: \"m\"\ninput [ { name: \"x\"\n  bogus: 1 } ]",
            Format::Pbtxt,
            "config.pbtxt",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("config.pbtxt line 3, column 3: field 'bogus' not found"),
            "{e}"
        );
        let e = normalize("max_batch_size: \"8\"", Format::Pbtxt, "config.pbtxt")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1, column 17"), "{e}");
        let e = normalize(
            "input [ { name: \"x\" data_type: TYPE_FLOAT32 } ]",
            Format::Pbtxt,
            "c",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("TYPE_FLOAT32"), "{e}");
        let e = normalize("input [ { name: \"x\" ", Format::Pbtxt, "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("c: expected '}' or a field name, but reached end of input"),
            "{e}"
        );
        let e = normalize(
            "ensemble_scheduling { step [ { model_name: \"a\" } ] }",
            Format::Pbtxt,
            "c",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`ensemble_scheduling` is set, and tpubox does not run ensembles"),
            "{e}"
        );
        let e = normalize(
            "dynamic_batching { }\nsequence_batching { }",
            Format::Pbtxt,
            "c",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("already set for oneof 'scheduling_choice'"),
            "{e}"
        );
        let e = normalize(
            "input [ { name: \"x\" optional: true } ]",
            Format::Pbtxt,
            "c",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`input[x].optional` is set"), "{e}");
    }

    #[test]
    fn json_takes_protobufs_spellings() {
        let n = normalize(
            r#"{"maxBatchSize": "16", "input": [{"name": "a", "data_type": "FP32", "dims": ["-1", 4]}],
                "dynamicBatching": {"maxQueueDelayMicroseconds": "100"}, "tpubox": {"component": "x.wasm"}}"#,
            Format::Json,
            "the config override",
        )
        .unwrap();
        assert_eq!(
            Value::Object(n.triton),
            json!({
                "max_batch_size": 16,
                "input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [-1, 4]}],
                "dynamic_batching": {"max_queue_delay_microseconds": 100},
            })
        );
        assert_eq!(n.tpubox, Some(json!({"component": "x.wasm"})));
        // An explicit 0 stays (no batch dimension), though protobuf leaves defaults out.
        let n = normalize(r#"{"max_batch_size": 0}"#, Format::Json, "c").unwrap();
        assert_eq!(n.triton.get("max_batch_size"), Some(&json!(0)));
        for (bad, says) in [
            (
                r#""parameters": {"config": {{"max_batch_size": "16"}}}"#,
                "not JSON",
            ),
            (
                r#"{"max_batch_size": 4, "no_such_field": 1}"#,
                "no_such_field",
            ),
            (r#"{"max_batch_size": "sixteen"}"#, "c: "),
            ("[1]", "must be an object"),
            (
                r#"{"dynamic_batching": {}, "sequence_batching": {}}"#,
                "exclusive",
            ),
        ] {
            let e = normalize(bad, Format::Json, "c").unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn toml_is_read_against_the_same_message() {
        let n = normalize(
            "max_batch_size = 8\n[[input]]\nname = \"t\"\ndata_type = \"BYTES\"\ndims = [-1]\n[version_policy.latest]\nnum_versions = 1\n[tpubox.limits]\nmax_device_mib = 4\n",
            Format::Toml,
            "config.toml",
        )
        .unwrap();
        assert_eq!(n.triton["input"][0]["data_type"], json!("TYPE_STRING"));
        assert_eq!(n.ignored, ["version_policy"]);
        assert_eq!(n.tpubox, Some(json!({"limits": {"max_device_mib": 4}})));
        let e = normalize("max_batch_sizes = 4", Format::Toml, "config.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_batch_sizes"), "{e}");
    }
}
