//! Entry points for the fuzz target `doors` (`fuzz/harness/doors.rs`): the session API's
//! request decoding, in process and without a device, through the daemon's own code: tonic's
//! gRPC framing with this crate's codec ([`crate::codec`]), then the conversions and checks the
//! service applies to a request before it reaches a session ([`crate::grpc`]), and the local
//! socket's header rules ([`crate::local`]). Not an API: nothing in the daemon calls it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use pjrt::PrimitiveType;
use prost::Message;
use tonic::Status;
use tonic::codec::{Codec as _, Decoder, Streaming};

use crate::grpc::v1::*;
use crate::grpc::{self as g, device_status};
use crate::local;
use crate::policy::SessionPolicy;
use crate::registry::{CallArg, ShardedCallArg};

/// A request body as HTTP/2 delivers it: its DATA frames, in order.
struct Frames(std::collections::VecDeque<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

/// How tonic hands a request body to a service: the messages of a gRPC request body whose DATA
/// frames are `frames`, decoded by `decoder` with messages up to `max_message_bytes`. `unary`:
/// tonic's unary and server-streaming path (one message; the error when there is none), else
/// a client stream read to its end with [`crate::codec::next`], as the service reads one.
///
/// Errors: the status the client would get.
pub fn decode_body<D>(
    decoder: D,
    frames: Vec<Bytes>,
    max_message_bytes: usize,
    unary: bool,
) -> Result<Vec<D::Item>, Status>
where
    D: Decoder<Error = Status> + Send + 'static,
    D::Item: Send + 'static,
{
    // The daemon's routers wrap every gRPC request body so (`codec::framed_request`).
    let body = crate::codec::FramedBody::new(Frames(frames.into()), unary, false);
    let mut stream = Streaming::new_request(decoder, body, None, Some(max_message_bytes));
    futures::executor::block_on(async {
        if unary {
            // tonic's `Grpc::unary` / `server_streaming`: the first message or its error.
            let m = stream.message().await?;
            return m
                .map(|m| vec![m])
                .ok_or_else(|| Status::internal("Missing request message."));
        }
        let mut out = Vec::new();
        while let Some(m) = crate::codec::next(&mut stream).await? {
            out.push(m);
        }
        Ok(out)
    })
}

fn decode<M>(frames: Vec<Bytes>, max: usize, unary: bool) -> Result<Vec<M>, Status>
where
    M: Message + Default + Send + 'static,
{
    let decoder = crate::codec::Codec::<M, M>::default().decoder();
    decode_body(decoder, frames, max, unary)
}

/// The methods of `tpubox.v1.Session`, in the proto's order.
pub const METHODS: [&str; 22] = [
    "Open",
    "Attach",
    "Close",
    "Info",
    "PutTensor",
    "GetTensor",
    "Free",
    "Compile",
    "Execute",
    "Call",
    "PutShardedTensor",
    "GetShardedTensor",
    "CallSharded",
    "Wait",
    "SetLaunchBlocking",
    "OpenWeights",
    "PublishWeights",
    "WeightVersions",
    "UnpublishWeights",
    "RunComponent",
    "Usage",
    "TenantUsage",
];

/// A tensor a request declares, as the session layer would admit it.
#[derive(Debug)]
pub struct Declared {
    /// Its element type.
    pub ty: PrimitiveType,
    /// Its dims, as sent.
    pub dims: Vec<u64>,
    /// Its dense size ([`tpubox_core::session::admit_dims`]).
    pub bytes: usize,
    /// The bytes that came with it.
    pub data: usize,
}

/// What one request became before it would reach a session.
#[derive(Debug, Default)]
pub struct Decoded {
    /// Messages decoded.
    pub messages: usize,
    /// Tensors it declares that a session with the given limit admits, with their data.
    pub tensors: Vec<Declared>,
    /// Positions (`donate`, `fetch`, `keep`) checked against a count, and how many they mark.
    pub marked: usize,
}

/// Decodes a request of `tpubox.v1.Session`'s method `METHODS[method]` from the DATA frames
/// of its body, with messages up to `max_message_bytes`, and applies what the service
/// applies before a session is involved: dtypes, specs, the stream rules of `PutTensor` and
/// `PutShardedTensor` (for a session allowed `max_device_bytes`, on a host of
/// `host_devices` devices), shardings, requested limits (against the default policy),
/// formats, component names; for `positions`, positions lists checked against that count of
/// arguments or results as the session checks them.
///
/// Errors: the status the client would get.
pub fn session_request(
    method: usize,
    frames: Vec<Bytes>,
    max_message_bytes: usize,
    max_device_bytes: u64,
    host_devices: usize,
    positions: usize,
) -> Result<Decoded, Status> {
    let mut d = Decoded::default();
    let max = max_message_bytes;
    let admit = |ty, dims: &[u64]| {
        tpubox_core::session::admit_dims(ty, dims, max_device_bytes).map_err(device_status)
    };
    let mark = |list: &[u32], what: &str| {
        tpubox_core::session::position_mask(positions, list, what, "argument(s)")
            .map(|m| m.iter().filter(|&&b| b).count())
            .map_err(device_status)
    };
    // A call's positions lists, as the session checks them.
    let marks = |donate: &[u32], fetch: &[u32], keep: &[u32]| -> Result<usize, Status> {
        Ok(mark(donate, "donate index")?
            + mark(fetch, "fetch position")?
            + mark(keep, "keep position")?)
    };
    // A call's inline tensors (dtype and dims, in argument order) with their data.
    let declare = |d: &mut Decoded,
                   declared: &mut dyn Iterator<Item = (PrimitiveType, Vec<u64>)>,
                   inline: Vec<Bytes>|
     -> Result<(), Status> {
        let mut inline = inline.into_iter();
        for (ty, dims) in declared {
            let bytes = admit(ty, &dims)?;
            let data = inline.next().map_or(0, |b| b.len());
            d.tensors.push(Declared {
                ty,
                dims,
                bytes,
                data,
            });
        }
        Ok(())
    };
    match METHODS.get(method).copied().unwrap_or("Open") {
        "Open" => {
            let r = one::<OpenRequest>(frames, max, &mut d)?;
            SessionPolicy::default()
                .limits()
                .narrowed(&g::requested(r.limits))
                .map_err(device_status)?;
            let _ = tpubox_core::logsafe::clip(&r.label);
        }
        "Attach" => {
            one::<AttachRequest>(frames, max, &mut d)?;
        }
        "Close" => {
            one::<CloseRequest>(frames, max, &mut d)?;
        }
        "Info" => {
            one::<InfoRequest>(frames, max, &mut d)?;
        }
        "PutTensor" => {
            let ms = decode::<PutTensorChunk>(frames, max, false)?;
            d.messages = ms.len();
            let mut ms = ms.into_iter();
            let first = ms.next().ok_or_else(|| {
                g::invalid("PutTensor got no message; the first carries the spec")
            })?;
            let (ty, dims) = g::put_header(&first)?;
            let expected = admit(ty, &dims)?;
            let too_much = || g::invalid("PutTensor sent more than its tensor holds");
            let mut data = g::Upload::new(first.data, expected, &too_much)?;
            for m in ms {
                g::put_more(&m)?;
                data.push(&m.data, &too_much)?;
            }
            d.tensors.push(Declared {
                ty,
                dims,
                bytes: expected,
                data: data.bytes().len(),
            });
        }
        "GetTensor" => {
            let r = one::<GetTensorRequest>(frames, max, &mut d)?;
            let n = g::chunk_bytes(r.chunk_bytes);
            assert!((g::MIN_CHUNK_BYTES..=g::MAX_CHUNK_BYTES).contains(&n));
        }
        "Free" => {
            one::<FreeRequest>(frames, max, &mut d)?;
        }
        "Compile" => {
            let r = one::<CompileRequest>(frames, max, &mut d)?;
            g::program_format(r.format, &r.program)?;
            g::optimization_level(&r.optimization_level)?;
            let _ = tpubox_core::declared::declared_devices(&r.program);
        }
        "Execute" => {
            let r = one::<ExecuteRequest>(frames, max, &mut d)?;
            d.marked = mark(&r.donate, "donate index")?;
        }
        "Call" => {
            let r = one::<CallRequest>(frames, max, &mut d)?;
            let (args, inline) = g::call_arguments(r.arguments)?;
            let mut declared = args.into_iter().filter_map(|a| match a {
                CallArg::Inline { ty, dims, .. } => Some((ty, dims)),
                _ => None,
            });
            declare(&mut d, &mut declared, inline)?;
            d.marked = marks(&r.donate, &r.fetch, &r.keep)?;
        }
        "PutShardedTensor" => {
            let ms = decode::<PutShardedChunk>(frames, max, false)?;
            d.messages = ms.len();
            let mut ms = ms.into_iter();
            let first = ms.next().ok_or_else(|| {
                g::invalid("PutShardedTensor got no message; the first carries the header")
            })?;
            let (spec, ty, sharding) = g::put_sharded_header(&first, host_devices)?;
            let expected = admit(ty, &spec.dims)?;
            shards(&sharding, &spec.dims, first.devices.len())?;
            let too_much = || g::invalid("PutShardedTensor sent more than its array holds");
            let mut data = g::Upload::new(first.data, expected, &too_much)?;
            for m in ms {
                g::put_sharded_more(&m)?;
                data.push(&m.data, &too_much)?;
            }
            d.tensors.push(Declared {
                ty,
                dims: spec.dims,
                bytes: expected,
                data: data.bytes().len(),
            });
        }
        "GetShardedTensor" => {
            let r = one::<GetShardedTensorRequest>(frames, max, &mut d)?;
            g::chunk_bytes(r.chunk_bytes);
            let spec = r
                .spec
                .ok_or_else(|| g::invalid("GetShardedTensor needs the global spec"))?;
            let ty = g::primitive(spec.dtype)?;
            let sharding = g::parse_sharding(&r.sharding)?;
            admit(ty, &spec.dims)?;
            shards(&sharding, &spec.dims, r.shards.len())?;
        }
        "CallSharded" => {
            let r = one::<CallShardedRequest>(frames, max, &mut d)?;
            let (args, inline) = g::sharded_arguments(r.arguments)?;
            let mut declared = args.into_iter().filter_map(|a| match a {
                ShardedCallArg::Inline { ty, dims } => Some((ty, dims)),
                _ => None,
            });
            declare(&mut d, &mut declared, inline)?;
            d.marked = marks(&r.donate, &r.fetch, &r.keep)?;
        }
        "Wait" => {
            one::<WaitRequest>(frames, max, &mut d)?;
        }
        "SetLaunchBlocking" => {
            one::<SetLaunchBlockingRequest>(frames, max, &mut d)?;
        }
        "OpenWeights" => {
            one::<OpenWeightsRequest>(frames, max, &mut d)?;
        }
        "PublishWeights" => {
            one::<PublishWeightsRequest>(frames, max, &mut d)?;
        }
        "WeightVersions" => {
            one::<WeightVersionsRequest>(frames, max, &mut d)?;
        }
        "UnpublishWeights" => {
            one::<UnpublishWeightsRequest>(frames, max, &mut d)?;
        }
        "RunComponent" => {
            let r = one::<RunComponentRequest>(frames, max, &mut d)?;
            if let Some(run_component_request::Component::Name(n)) = &r.component {
                let _ = g::valid_component_name(n);
            }
            let _ = g::run_deadline(r.timeout_seconds, Some(std::time::Duration::from_secs(60)));
        }
        "Usage" => {
            one::<UsageRequest>(frames, max, &mut d)?;
        }
        _ => {
            one::<TenantUsageRequest>(frames, max, &mut d)?;
        }
    }
    Ok(d)
}

fn one<M>(frames: Vec<Bytes>, max: usize, d: &mut Decoded) -> Result<M, Status>
where
    M: Message + Default + Send + 'static,
{
    let mut ms = decode::<M>(frames, max, true)?;
    d.messages = ms.len();
    Ok(ms.remove(0))
}

/// The shards of a sharded array of `dims` on `devices` devices, as the session lays it out.
fn shards(sharding: &pjrt::HloSharding, dims: &[u64], devices: usize) -> Result<(), Status> {
    let dims = tpubox_core::types::dims_from_u64(dims).map_err(device_status)?;
    if devices > 0 {
        // The session's own errors for a sharding that does not fit the array or devices are
        // `invalid-argument`, like these.
        if let Ok(s) = sharding.shards(&dims, devices) {
            assert_eq!(s.len(), devices, "one shard per device");
        }
    }
    Ok(())
}

/// What a local-socket request header became: its op and the bytes its tail declares.
#[derive(Debug)]
pub struct LocalDecoded {
    /// The request's op.
    pub op: &'static str,
    /// Bytes declared after the header.
    pub tail: usize,
    /// Inline tensors a call or put declares: dtype and dims.
    pub tensors: Vec<(PrimitiveType, Vec<u64>)>,
}

/// The local socket's rules for one request: its 4-byte length (`len`), its JSON `header`
/// (which must be as long as `len` says: what the daemon reads), the tail it declares, and
/// the conversions of a put's dtype, a call's arguments and a collective's kind; for a call,
/// the packing of its inline tensors at their sizes for a session allowed
/// `max_device_bytes`.
///
/// Errors: the error kind and message the client would get.
pub fn local_request(
    len: [u8; 4],
    header: &[u8],
    max_device_bytes: u64,
) -> Result<LocalDecoded, (&'static str, String)> {
    let f = |e: local::Failure| (e.0, e.1);
    let n = local::header_length(len).map_err(f)?;
    let header = &header[..n.min(header.len())];
    let req = local::parse_header(header).map_err(f)?;
    let tail = req.tail();
    local::check_tail(tail).map_err(f)?;
    let mut out = LocalDecoded {
        op: req.op(),
        tail,
        tensors: Vec::new(),
    };
    match req {
        local::LocalRequest::Put { dtype, dims, .. } => {
            let ty = local::local_dtype(&dtype).map_err(f)?;
            tpubox_core::session::admit_dims(ty, &dims, max_device_bytes)
                .map_err(|e| f(e.into()))?;
            out.tensors.push((ty, dims));
        }
        local::LocalRequest::Call { arguments, .. } => {
            let mut sizes = Vec::new();
            for a in local::call_arguments(arguments).map_err(f)? {
                if let CallArg::Inline { ty, dims, .. } = a {
                    sizes.push(
                        tpubox_core::session::admit_dims(ty, &dims, max_device_bytes)
                            .map_err(|e| f(e.into()))?,
                    );
                    out.tensors.push((ty, dims));
                }
            }
            let (offsets, total) = local::packed(&sizes).map_err(f)?;
            for (&at, &n) in offsets.iter().zip(&sizes) {
                assert!(at.is_multiple_of(local::PACK_ALIGN) && at + n <= total);
            }
        }
        local::LocalRequest::Collective {
            kind,
            reduce,
            root,
            peer,
            tag,
            ..
        } => {
            local::collective_of(&kind, reduce.as_deref(), root, peer, tag.unwrap_or(0))
                .map_err(f)?;
        }
        _ => {}
    }
    Ok(out)
}

#[cfg(test)]
mod codec_tests {
    use bytes::Bytes;
    use tonic::codec::Codec as _;

    use crate::grpc::v1::GetTensorRequest;

    /// Decodes `body` as the daemon does (framing check, tonic, this codec): the messages.
    fn decode(body: &[u8], unary: bool) -> Result<usize, tonic::Status> {
        let decoder =
            crate::codec::Codec::<GetTensorRequest, GetTensorRequest>::default().decoder();
        super::decode_body(decoder, vec![Bytes::copy_from_slice(body)], 1 << 20, unary)
            .map(|m| m.len())
    }

    /// A broken gRPC framing is `INVALID_ARGUMENT` with its kind, in a unary call too, where
    /// tonic answered `INTERNAL` before the service saw the request (found by the fuzz target
    /// `doors`: a unary call with an empty body, "Missing request message.").
    #[test]
    fn a_broken_framing_is_invalid_argument() {
        // One whole message (`handle: 1`), and a message of no bytes.
        assert_eq!(decode(&[0, 0, 0, 0, 2, 8, 1], true).unwrap(), 1);
        assert_eq!(decode(&[0, 0, 0, 0, 0], true).unwrap(), 1);
        // A client stream may be empty.
        assert_eq!(decode(&[], false).unwrap(), 0);
        for (body, unary) in [
            (&[][..], true),
            (&[0, 0, 0, 0, 9, 8][..], true),
            (&[0, 0, 0, 0, 9, 8][..], false),
            (&[0, 0, 0][..], false),
            (&[2, 0, 0, 0, 0][..], true),
            (&[1, 0, 0, 0, 0][..], false),
        ] {
            let e = decode(body, unary).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{body:?}: {e:?}");
            assert_eq!(
                e.metadata().get(crate::grpc::ERROR_KIND_KEY).unwrap(),
                "invalid-argument"
            );
        }
    }
}
