//! Triton's generate extension (`POST /v2/models/{m}/generate` and `/generate_stream`): a flat
//! JSON request whose keys are the model's input names (`{"text_input": "…", "parameters":
//! {…}}`) and a flat JSON response whose keys are its output names. This module translates it
//! to and from an ordinary inference request; the REST door ([`crate::rest`]) serves it, the
//! stream as server-sent events. A model with one response per request answers the stream
//! with one event.

use serde_json::{Map, Value, json};

use super::error::{ServeError, ServeResult};
use super::model::Model;
use super::protocol::{
    InferRequest, InferResponse, SEQUENCE_END, SEQUENCE_ID, SEQUENCE_START, SequenceId,
    SequenceRequest, Tensor, data_from_json, data_to_json,
};

/// The inference request of a generate body for `model`: each key but `id` and `parameters`
/// is an input, its value a scalar or a (nested) array, shaped as the input's declared dims
/// when they are fixed, else `[n]` for `n` elements, with a batch of 1 when the model
/// batches. `parameters` may carry `sequence_id`, `sequence_start`, `sequence_end`; others
/// are ignored.
///
/// Errors: bad request for a body that is not an object, a key that is not an input, a
/// value of the wrong type, a count that does not match fixed dims.
pub fn request(model: &Model, body: &Value) -> ServeResult<InferRequest> {
    let Some(obj) = body.as_object() else {
        return Err(ServeError::bad_request(
            "the generate request must be a JSON object of input names",
        ));
    };
    let batched = model.metadata.max_batch_size > 0;
    let mut inputs = Vec::new();
    for (k, v) in obj {
        if k == "id" || k == "parameters" {
            continue;
        }
        let Some(d) = model.metadata.inputs.iter().find(|d| d.name == *k) else {
            return Err(ServeError::bad_request(format!(
                "model '{}' has no input `{}` (a generate request's keys are input names)",
                model.name,
                tpubox_core::logsafe::clip(k)
            )));
        };
        let n = count(v);
        let fixed = d.dims.iter().all(|&x| x >= 0);
        let mut shape: Vec<u64> = if fixed {
            let want: i64 = d.dims.iter().product();
            if want as u64 != n {
                return Err(ServeError::bad_request(format!(
                    "input `{k}` takes {want} elements (dims {:?}), the request has {n}",
                    d.dims
                )));
            }
            d.dims.iter().map(|&x| x as u64).collect()
        } else {
            vec![n]
        };
        if batched {
            shape.insert(0, 1);
        }
        inputs.push(Tensor {
            name: k.clone(),
            datatype: d.datatype,
            shape,
            data: data_from_json(k, d.datatype, v)?,
        });
    }
    let params = obj.get("parameters").and_then(Value::as_object);
    let sequence = params.and_then(|p| {
        let id = match p.get(SEQUENCE_ID)? {
            Value::Number(n) => SequenceId::Number(n.as_u64()?),
            Value::String(s) => SequenceId::Text(s.clone()),
            _ => return None,
        };
        let flag = |k| p.get(k).and_then(Value::as_bool).unwrap_or(false);
        Some(SequenceRequest {
            id,
            start: flag(SEQUENCE_START),
            end: flag(SEQUENCE_END),
        })
    });
    Ok(InferRequest {
        id: obj.get("id").and_then(Value::as_str).map(str::to_string),
        inputs,
        sequence,
        ..InferRequest::default()
    })
}

fn count(v: &Value) -> u64 {
    match v {
        Value::Array(items) => items.iter().map(count).sum(),
        _ => 1,
    }
}

/// The generate response of `resp`: `model_name`, `model_version`, the request's `id`, and
/// each output by name, a scalar when it has one element (the usual `text_output`), else its
/// flat array.
pub fn response(resp: &InferResponse) -> Value {
    let mut out = Map::new();
    out.insert("model_name".into(), json!(resp.model_name));
    out.insert("model_version".into(), json!(resp.model_version));
    if let Some(id) = &resp.id {
        out.insert("id".into(), json!(id));
    }
    for t in &resp.outputs {
        let v = data_to_json(t);
        let v = match v {
            Value::Array(mut items) if items.len() == 1 => items.remove(0),
            other => other,
        };
        out.insert(t.name.clone(), v);
    }
    Value::Object(out)
}
