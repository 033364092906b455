//! Dynamic batching: one queue per model, shared by all its instances. Requests from every
//! client wait there; an instance takes the oldest and, when the model batches, every later
//! request of the same shape (apart from the batch dimension) up to `max_batch_size`, as soon
//! as that many are waiting, a preferred batch size is reached, or the oldest has waited the
//! queue delay. The batch runs as one `infer`; its outputs are split back along the batch
//! dimension.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc, oneshot};

use super::error::{ServeError, ServeErrorKind, ServeResult};
use super::protocol::{Datatype, Tensor, bytes_elements, element_count};

/// A request waiting in the queue; its inputs are in the model's declared order.
pub struct Pending {
    /// Inputs, validated, in declared order.
    pub inputs: Vec<Tensor>,
    /// The request's batch size (its leading dimension), 1 for a model without batching.
    pub batch: u64,
    /// When it joined the queue.
    pub enqueued: Instant,
    /// Its sequence (a hash of tenant and sequence id) for a stateful model: two requests of
    /// one sequence never share a batch.
    pub sequence: Option<u64>,
    /// Where its outputs (or error) go.
    pub reply: oneshot::Sender<ServeResult<Batched>>,
    /// For a request to a decoupled model: where its responses go, one by one
    /// ([`StreamItem`]); `reply` is then unused.
    pub stream: Option<mpsc::Sender<StreamItem>>,
}

/// One message of a streamed request: a response (its outputs, in declared order), the end
/// (`Ok(None)`), or the error that ended it. A channel that closes without either ended
/// because the model's instance stopped.
pub type StreamItem = ServeResult<Option<Vec<Tensor>>>;

/// What a request gets back from a batch.
#[derive(Debug)]
pub struct Batched {
    /// Its share of the outputs.
    pub outputs: Vec<Tensor>,
    /// How long it waited in the queue.
    pub queued: Duration,
    /// How long the `infer` call took.
    pub compute: Duration,
    /// The weight-set versions the batch's outputs were read from.
    pub weights: std::sync::Arc<[tpubox_core::session::WeightTag]>,
}

impl Pending {
    /// Inputs' dims after the batch dimension; requests batch together only when equal.
    fn key(&self) -> Vec<&[u64]> {
        self.inputs
            .iter()
            .map(|t| t.shape.get(1..).unwrap_or(&[]))
            .collect()
    }
}

/// How a model's queue forms batches.
#[derive(Debug, Clone)]
pub struct BatchPolicy {
    /// Merge requests at all (the model has a batch dimension and dynamic batching is on).
    pub batching: bool,
    /// Largest batch.
    pub max_batch_size: u64,
    /// Batch sizes run as soon as reached.
    pub preferred: Vec<u64>,
    /// Longest the oldest request waits for others.
    pub max_delay: Duration,
    /// Requests that may wait; 0 for no limit.
    pub max_queue_size: usize,
}

/// A model's request queue.
pub struct Queue {
    state: Mutex<State>,
    notify: Notify,
    policy: BatchPolicy,
}

struct State {
    pending: VecDeque<Pending>,
    closed: bool,
}

impl Queue {
    /// An empty, open queue.
    pub fn new(policy: BatchPolicy) -> Self {
        Queue {
            state: Mutex::new(State {
                pending: VecDeque::new(),
                closed: false,
            }),
            notify: Notify::new(),
            policy,
        }
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.state.lock().unwrap().pending.len()
    }

    /// Whether no request is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds a request.
    ///
    /// Errors: too many requests (limit `max-queue-size`) when the queue is full; not ready
    /// when the model is being unloaded.
    pub fn push(&self, p: Pending) -> ServeResult<()> {
        let mut st = self.state.lock().unwrap();
        if st.closed {
            return Err(ServeError::new(
                ServeErrorKind::NotReady,
                "the model is being unloaded",
            ));
        }
        if self.policy.max_queue_size > 0 && st.pending.len() >= self.policy.max_queue_size {
            return Err(ServeError::limited(
                "max-queue-size",
                format!(
                    "the model's queue is full ({} requests waiting; default_queue_policy.max_queue_size)",
                    st.pending.len()
                ),
            ));
        }
        st.pending.push_back(p);
        drop(st);
        self.notify.notify_one();
        Ok(())
    }

    /// Stops accepting requests; those waiting are still served. Wakes every waiting instance.
    pub fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.notify.notify_waiters();
    }

    /// Closes the queue and fails every request still waiting with `err` (at shutdown, once
    /// the drain time is up).
    pub fn abort(&self, err: ServeError) {
        let pending: Vec<Pending> = {
            let mut st = self.state.lock().unwrap();
            st.closed = true;
            st.pending.drain(..).collect()
        };
        self.notify.notify_waiters();
        for p in pending {
            let _ = p.reply.send(Err(err.clone()));
        }
    }

    /// The next batch for an instance: waits until one is due. `None` once the queue is closed
    /// and empty.
    pub async fn next_batch(&self) -> Option<Vec<Pending>> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_take() {
                Take::Batch(b) => return Some(b),
                Take::Closed => return None,
                Take::Empty => notified.await,
                Take::WaitUntil(due) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(due.into()) => {}
                    }
                }
            }
        }
    }

    /// The batch that is due now, if any, without waiting.
    pub fn try_next(&self) -> Option<Vec<Pending>> {
        match self.try_take() {
            Take::Batch(b) => Some(b),
            _ => None,
        }
    }

    /// Takes the batch that is due now, if any.
    fn try_take(&self) -> Take {
        let mut st = self.state.lock().unwrap();
        let Some(first) = st.pending.front() else {
            return if st.closed { Take::Closed } else { Take::Empty };
        };
        if !self.policy.batching {
            return Take::Batch(vec![st.pending.pop_front().unwrap()]);
        }
        let key: Vec<Vec<u64>> = first.key().into_iter().map(<[u64]>::to_vec).collect();
        let due = first.enqueued + self.policy.max_delay;
        let mut total = 0u64;
        let mut take = Vec::new();
        let mut sequences = Vec::new();
        for (i, p) in st.pending.iter().enumerate() {
            let same = p.key().iter().zip(&key).all(|(a, b)| *a == b.as_slice());
            let seq_free = p.sequence.is_none_or(|s| !sequences.contains(&s));
            if same && seq_free && total + p.batch <= self.policy.max_batch_size {
                total += p.batch;
                take.push(i);
                sequences.extend(p.sequence);
            }
        }
        let full = total >= self.policy.max_batch_size
            || self.policy.preferred.contains(&total)
            || Instant::now() >= due
            || st.closed;
        if !full {
            return Take::WaitUntil(due);
        }
        let mut batch = Vec::with_capacity(take.len());
        for (n, i) in take.into_iter().enumerate() {
            batch.push(st.pending.remove(i - n).unwrap());
        }
        // Another instance may take what is left.
        if !st.pending.is_empty() {
            self.notify.notify_one();
        }
        Take::Batch(batch)
    }
}

enum Take {
    Batch(Vec<Pending>),
    Empty,
    Closed,
    WaitUntil(Instant),
}

/// Merges the inputs of `batch` along the batch dimension (input `i` of each request, in
/// order).
pub fn merge(batch: &[Pending]) -> Vec<Tensor> {
    if batch.len() == 1 {
        return batch[0].inputs.clone();
    }
    let first = &batch[0].inputs;
    first
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut shape = t.shape.clone();
            shape[0] = batch.iter().map(|p| p.inputs[i].shape[0]).sum();
            let mut data = Vec::with_capacity(batch.iter().map(|p| p.inputs[i].data.len()).sum());
            for p in batch {
                data.extend_from_slice(&p.inputs[i].data);
            }
            Tensor {
                name: t.name.clone(),
                datatype: t.datatype,
                shape,
                data,
            }
        })
        .collect()
}

/// Splits a batch's outputs back into one list per request, by the requests' batch sizes.
///
/// Errors: internal (the model broke its contract) when an output's leading dimension is not
/// the batch's total or its data does not match its shape.
pub fn split(outputs: Vec<Tensor>, sizes: &[u64]) -> ServeResult<Vec<Vec<Tensor>>> {
    if sizes.len() == 1 {
        return Ok(vec![outputs]);
    }
    let total: u64 = sizes.iter().sum();
    let mut per: Vec<Vec<Tensor>> = sizes.iter().map(|_| Vec::new()).collect();
    for t in outputs {
        if t.shape.first() != Some(&total) {
            return Err(ServeError::new(
                ServeErrorKind::Internal,
                format!(
                    "output `{}` has shape {:?}, but its leading (batch) dimension must be {total}",
                    t.name, t.shape
                ),
            ));
        }
        let row = element_count(&t.shape[1..]).unwrap_or(0);
        let parts: Vec<Vec<u8>> = match t.datatype.element_size() {
            Some(size) => {
                let row_bytes = (row as usize) * size;
                let mut off = 0;
                sizes
                    .iter()
                    .map(|&n| {
                        let len = row_bytes * n as usize;
                        let part = t.data[off..off + len].to_vec();
                        off += len;
                        part
                    })
                    .collect()
            }
            None => {
                debug_assert_eq!(t.datatype, Datatype::Bytes);
                let elems = bytes_elements(&t.data)
                    .map_err(|e| ServeError::new(ServeErrorKind::Internal, e))?;
                let mut it = elems.into_iter();
                sizes
                    .iter()
                    .map(|&n| {
                        let mut part = Vec::new();
                        for e in it.by_ref().take((row * n) as usize) {
                            super::protocol::push_bytes_element(&mut part, e);
                        }
                        part
                    })
                    .collect()
            }
        };
        for ((out, data), &n) in per.iter_mut().zip(parts).zip(sizes) {
            let mut shape = t.shape.clone();
            shape[0] = n;
            out.push(Tensor {
                name: t.name.clone(),
                datatype: t.datatype,
                shape,
                data,
            });
        }
    }
    Ok(per)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(rows: u64, n: u64) -> (Pending, oneshot::Receiver<ServeResult<Batched>>) {
        let (tx, rx) = oneshot::channel();
        let data: Vec<u8> = (0..rows * n)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        (
            Pending {
                sequence: None,
                stream: None,
                inputs: vec![Tensor {
                    name: "x".into(),
                    datatype: Datatype::Fp32,
                    shape: vec![rows, n],
                    data,
                }],
                batch: rows,
                enqueued: Instant::now(),
                reply: tx,
            },
            rx,
        )
    }

    fn policy(max: u64, delay_ms: u64) -> BatchPolicy {
        BatchPolicy {
            batching: true,
            max_batch_size: max,
            preferred: vec![],
            max_delay: Duration::from_millis(delay_ms),
            max_queue_size: 3,
        }
    }

    #[tokio::test]
    async fn merges_same_shapes_up_to_the_max_and_keeps_others_waiting() {
        let q = Queue::new(policy(4, 10_000));
        let mut rxs = Vec::new();
        for (rows, n) in [(1, 2), (2, 3), (3, 2)] {
            let (p, rx) = pending(rows, n);
            q.push(p).unwrap();
            rxs.push(rx);
        }
        let (p, _rx) = pending(1, 2);
        let e = q.push(p).unwrap_err();
        assert_eq!(e.limit, Some("max-queue-size"));
        // 1 + 3 rows of width 2 fill the batch of 4; the width-3 request waits.
        let b = q.next_batch().await.unwrap();
        assert_eq!(b.iter().map(|p| p.batch).collect::<Vec<_>>(), [1, 3]);
        let merged = merge(&b);
        assert_eq!(merged[0].shape, [4, 2]);
        let parts = split(merged, &[1, 3]).unwrap();
        assert_eq!(parts[0][0].shape, [1, 2]);
        assert_eq!(parts[1][0].data, b[1].inputs[0].data);
        assert_eq!(q.len(), 1);
        q.close();
        let b = q.next_batch().await.unwrap();
        assert_eq!(b[0].batch, 2);
        assert!(q.next_batch().await.is_none());
    }

    #[tokio::test]
    async fn a_lone_request_runs_after_the_delay() {
        let q = Queue::new(policy(8, 20));
        let (p, _rx) = pending(1, 2);
        let start = Instant::now();
        q.push(p).unwrap();
        let b = q.next_batch().await.unwrap();
        assert_eq!(b.len(), 1);
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn split_checks_the_batch_dimension_and_bytes() {
        let mut data = Vec::new();
        for s in ["a", "bb", "ccc"] {
            super::super::protocol::push_bytes_element(&mut data, s.as_bytes());
        }
        let t = Tensor {
            name: "s".into(),
            datatype: Datatype::Bytes,
            shape: vec![3],
            data,
        };
        let parts = split(vec![t.clone()], &[2, 1]).unwrap();
        assert_eq!(bytes_elements(&parts[1][0].data).unwrap(), [b"ccc"]);
        let e = split(vec![t], &[1, 1]).unwrap_err();
        assert_eq!(e.kind, ServeErrorKind::Internal);
    }
}
