//! Sequence batching (Triton's `[sequence_batching]`): stateful models whose state lives in an
//! instance between requests. A request names its sequence (`sequence_id`, with
//! `sequence_start` on the first and `sequence_end` on the last); every request of a sequence
//! runs on the instance its start was given to, in order, and the server fills the model's
//! control inputs (START, END, READY, CORRID) for each batch row. Requests of different
//! sequences on one instance batch together; two of one sequence never share a batch.
//!
//! Sequences are per tenant: the key is (tenant, sequence id), so one tenant cannot join,
//! end or read another's sequence by guessing its id. A sequence whose instance was replaced
//! (it trapped) has lost its state: its next request fails with an error naming it, and the
//! sequence is released. A sequence idle for `max_sequence_idle_microseconds` is released.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::config::{Control, SequenceBatching};
use super::error::{ServeError, ServeResult};
use super::instance::TensorDecl;
use super::protocol::{Datatype, SequenceId, SequenceRequest, Tensor};

/// What one control input carries.
#[derive(Debug, Clone)]
enum ControlKind {
    /// A flag: its datatype and the encoded false and true values.
    Flag {
        which: Flag,
        datatype: Datatype,
        values: [Vec<u8>; 2],
    },
    /// The correlation id, in this datatype.
    CorrId(Datatype),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flag {
    Start,
    End,
    Ready,
}

/// A sequence in flight.
#[derive(Debug)]
struct Slot {
    instance: usize,
    generation: u64,
    last_used: Instant,
}

/// The sequences of one model and the control inputs it takes.
#[derive(Debug)]
pub struct Sequencer {
    model: String,
    idle: Duration,
    controls: Vec<(String, ControlKind)>,
    /// Whether tensors carry a batch dimension.
    batched: bool,
    /// Per instance: bumped each time the instance is replaced (its state is gone).
    generations: Vec<AtomicU64>,
    slots: Mutex<HashMap<(String, SequenceId), Slot>>,
}

fn flag_values(name: &str, c: &Control) -> Result<(Datatype, [Vec<u8>; 2])> {
    let two = |n: usize| n == 2;
    if two(c.int32_false_true.len()) {
        let v = &c.int32_false_true;
        return Ok((
            Datatype::Int32,
            [v[0].to_le_bytes().to_vec(), v[1].to_le_bytes().to_vec()],
        ));
    }
    if two(c.fp32_false_true.len()) {
        let v = &c.fp32_false_true;
        return Ok((
            Datatype::Fp32,
            [v[0].to_le_bytes().to_vec(), v[1].to_le_bytes().to_vec()],
        ));
    }
    if two(c.bool_false_true.len()) {
        let v = &c.bool_false_true;
        return Ok((Datatype::Bool, [vec![u8::from(v[0])], vec![u8::from(v[1])]]));
    }
    bail!(
        "control input `{name}` ({}): give its false and true values (int32_false_true, fp32_false_true or bool_false_true, two each)",
        c.kind
    )
}

impl Sequencer {
    /// The sequencer of model `model` from its `[sequence_batching]`, checked against its
    /// declared inputs (`batched`: the model has a batch dimension).
    ///
    /// Errors: a control kind Triton does not define, a control input the model does not
    /// declare or declares with another datatype or a shape other than `[1]`, a flag without
    /// two values, a CORRID type other than UINT64, INT64, UINT32, INT32, STRING, no READY-less model
    /// check (a model needs at least START or READY to know anything).
    pub fn new(
        model: &str,
        cfg: &SequenceBatching,
        inputs: &[TensorDecl],
        batched: bool,
        instances: usize,
    ) -> Result<Sequencer> {
        let mut controls = Vec::new();
        for ci in &cfg.control_input {
            let [c] = ci.control.as_slice() else {
                bail!(
                    "sequence_batching: control input `{}` must have exactly one control",
                    ci.name
                );
            };
            let kind = match c.kind.as_str() {
                "CONTROL_SEQUENCE_START" | "CONTROL_SEQUENCE_END" | "CONTROL_SEQUENCE_READY" => {
                    let which = match c.kind.as_str() {
                        "CONTROL_SEQUENCE_START" => Flag::Start,
                        "CONTROL_SEQUENCE_END" => Flag::End,
                        _ => Flag::Ready,
                    };
                    let (datatype, values) = flag_values(&ci.name, c)?;
                    ControlKind::Flag {
                        which,
                        datatype,
                        values,
                    }
                }
                "CONTROL_SEQUENCE_CORRID" => {
                    let d = c
                        .data_type
                        .as_deref()
                        .and_then(Datatype::from_name)
                        .unwrap_or(Datatype::Uint64);
                    if !matches!(
                        d,
                        Datatype::Uint64
                            | Datatype::Int64
                            | Datatype::Uint32
                            | Datatype::Int32
                            | Datatype::Bytes
                    ) {
                        bail!(
                            "control input `{}`: CORRID as {} is not supported (UINT64, INT64, UINT32, INT32, STRING)",
                            ci.name,
                            d.name()
                        );
                    }
                    ControlKind::CorrId(d)
                }
                other => bail!(
                    "control input `{}`: unknown control kind `{other}` (CONTROL_SEQUENCE_START, _END, _READY, _CORRID)",
                    ci.name
                ),
            };
            let want = match &kind {
                ControlKind::Flag { datatype, .. } => *datatype,
                ControlKind::CorrId(d) => *d,
            };
            let Some(decl) = inputs.iter().find(|d| d.name == ci.name) else {
                bail!("control input `{}` is not an input of the model", ci.name);
            };
            if decl.datatype != want || decl.dims != [1] {
                bail!(
                    "control input `{}`: the model declares it {} {:?}; the control needs {} [1]",
                    ci.name,
                    decl.datatype.name(),
                    decl.dims,
                    want.name()
                );
            }
            controls.push((ci.name.clone(), kind));
        }
        Ok(Sequencer {
            model: model.to_string(),
            idle: Duration::from_micros(cfg.max_sequence_idle_microseconds),
            controls,
            batched,
            generations: (0..instances).map(|_| AtomicU64::new(0)).collect(),
            slots: Mutex::new(HashMap::new()),
        })
    }

    /// The names of the inputs the server fills.
    pub fn control_names(&self) -> impl Iterator<Item = &str> {
        self.controls.iter().map(|(n, _)| n.as_str())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, SequenceId), Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The instance `tenant`'s request of sequence `seq` runs on. A start is given the
    /// instance with the fewest sequences (a start of a sequence already live restarts it
    /// there); a later request finds its sequence's.
    ///
    /// Errors: bad request, in Triton's words, without a sequence id or for a sequence that
    /// was not started (or was released: idle, ended); bad request naming the sequence when
    /// its instance was replaced since its start (its state is gone), after which the
    /// sequence is released.
    pub fn route(&self, tenant: &str, seq: &SequenceRequest) -> ServeResult<usize> {
        if seq.id == SequenceId::Number(0) || seq.id == SequenceId::Text(String::new()) {
            return Err(super::wording::no_correlation_id(&self.model));
        }
        let now = Instant::now();
        let mut slots = self.lock();
        // Release the sequences idle past the limit (lazily: here, on any request).
        slots.retain(|_, s| now.saturating_duration_since(s.last_used) <= self.idle);
        let key = (tenant.to_string(), seq.id.clone());
        if seq.start {
            let instance = (0..self.generations.len())
                .min_by_key(|i| slots.values().filter(|s| s.instance == *i).count())
                .unwrap_or(0);
            let instance = slots.get(&key).map_or(instance, |s| s.instance);
            slots.insert(
                key,
                Slot {
                    instance,
                    generation: self.generations[instance].load(Ordering::SeqCst),
                    last_used: now,
                },
            );
            return Ok(instance);
        }
        let Some(slot) = slots.get_mut(&key) else {
            return Err(super::wording::sequence_not_started(&self.model, &seq.id));
        };
        if self.generations[slot.instance].load(Ordering::SeqCst) != slot.generation {
            slots.remove(&key);
            return Err(ServeError::bad_request(format!(
                "sequence {} of model '{}' lost its state: the model instance that held it failed and was replaced; start the sequence again",
                seq.id, self.model
            )));
        }
        slot.last_used = now;
        Ok(slot.instance)
    }

    /// Marks the end of `tenant`'s request of `seq`: with `sequence_end`, or when it failed
    /// because its instance broke, the sequence is released.
    pub fn finish(&self, tenant: &str, seq: &SequenceRequest, instance_lost: bool) {
        let key = (tenant.to_string(), seq.id.clone());
        let mut slots = self.lock();
        if seq.end || instance_lost {
            slots.remove(&key);
        } else if let Some(s) = slots.get_mut(&key) {
            s.last_used = Instant::now();
        }
    }

    /// Instance `index` was replaced: the sequences it held have lost their state.
    pub fn instance_replaced(&self, index: usize) {
        if let Some(g) = self.generations.get(index) {
            g.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The control tensors of one request of `seq` (batch size 1), to add to its inputs.
    pub fn controls(&self, seq: &SequenceRequest) -> Vec<Tensor> {
        let shape = if self.batched { vec![1, 1] } else { vec![1] };
        self.controls
            .iter()
            .map(|(name, kind)| {
                let (datatype, data) = match kind {
                    ControlKind::Flag {
                        which,
                        datatype,
                        values,
                    } => {
                        let on = match which {
                            Flag::Start => seq.start,
                            Flag::End => seq.end,
                            Flag::Ready => true,
                        };
                        (*datatype, values[usize::from(on)].clone())
                    }
                    ControlKind::CorrId(d) => (*d, corrid_bytes(&seq.id, *d)),
                };
                Tensor {
                    name: name.clone(),
                    datatype,
                    shape: shape.clone(),
                    data,
                }
            })
            .collect()
    }
}

/// The correlation id as `d`: as `TYPE_STRING` (BYTES) the id's text, a number in decimal
/// (as Triton fills a string CORRID); as a number a string id's 64-bit FNV-1a hash (models with
/// numeric CORRIDs still tell string-named sequences apart).
fn corrid_bytes(id: &SequenceId, d: Datatype) -> Vec<u8> {
    if d == Datatype::Bytes {
        let text = match id {
            SequenceId::Number(n) => n.to_string(),
            SequenceId::Text(t) => t.clone(),
        };
        let mut out = Vec::with_capacity(4 + text.len());
        super::protocol::push_bytes_element(&mut out, text.as_bytes());
        return out;
    }
    let n = match id {
        SequenceId::Number(n) => *n,
        SequenceId::Text(t) => t.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        }),
    };
    match d {
        Datatype::Uint32 | Datatype::Int32 => (n as u32).to_le_bytes().to_vec(),
        _ => n.to_le_bytes().to_vec(),
    }
}
