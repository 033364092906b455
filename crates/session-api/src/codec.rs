//! The session API's gRPC codec: prost's, with every message that fails to decode answered
//! `INVALID_ARGUMENT` (tonic's default is `INTERNAL`, as if the daemon were at fault), in the
//! request of a unary call and in every message of a stream. [`next`] does the same for the
//! framing errors of a client stream (a message cut short, a bad compression flag, a body
//! that failed), which tonic reports before the codec runs.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{Codec as TonicCodec, DecodeBuf, Decoder};

/// prost's codec for the generated service, decode errors as `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct Codec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec { _pd: PhantomData }
    }
}

impl<T, U> TonicCodec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = InvalidArgumentDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        InvalidArgumentDecoder {
            inner: tonic_prost::ProstDecoder::default(),
        }
    }
}

/// [`Codec`]'s decoder: prost's, its errors as `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct InvalidArgumentDecoder<U> {
    inner: tonic_prost::ProstDecoder<U>,
}

/// `INVALID_ARGUMENT` for bytes prost cannot decode as a `U` (a protobuf message type), naming
/// the type and `why` (prost's reason, cut to
/// [`FIELD_BYTES`](tpubox_core::logsafe::FIELD_BYTES)). Both gRPC doors answer so.
pub fn undecodable<U>(why: &str) -> Status {
    Status::invalid_argument(format!(
        "the message is not a valid {}: {}",
        std::any::type_name::<U>()
            .rsplit("::")
            .next()
            .unwrap_or("message"),
        tpubox_core::logsafe::clip(why)
    ))
}

impl<U: Message + Default> Decoder for InvalidArgumentDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner
            .decode(buf)
            .map_err(|e| undecodable::<U>(e.message()))
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.inner.buffer_settings()
    }
}

/// The next message of a client stream; a stream that breaks its framing (tonic's `INTERNAL`
/// or `UNKNOWN`: a message cut short, a bad compression flag, a body that failed) is the
/// client's error, `INVALID_ARGUMENT`; other codes (a message over the size limit, a
/// cancellation) stay as they are.
///
/// Errors: the stream's, mapped as above.
pub async fn next<T>(stream: &mut tonic::Streaming<T>) -> Result<Option<T>, Status> {
    stream.message().await.map_err(|s| match s.code() {
        tonic::Code::Internal | tonic::Code::Unknown => Status::invalid_argument(format!(
            "the request stream is malformed: {}",
            tpubox_core::logsafe::clip(s.message())
        )),
        _ => s,
    })
}

/// A gRPC request body checked for its framing as it streams in (gRPC's length-prefixed
/// messages: a flag byte, 0 or 1 when the request names a `grpc-encoding`, and a 4-byte
/// big-endian length). tonic reports a broken framing as `INTERNAL` ("Unexpected EOF decoding
/// stream.", "Missing request message.", an invalid compression flag), and for a unary or
/// server-streaming call before the service sees the request, so no handler can map it: this
/// body fails first, with `INVALID_ARGUMENT` (and the `tpubox-error-kind` trailer), which tonic
/// passes on. Its data passes through unchanged.
#[derive(Debug)]
pub struct FramedBody<B> {
    inner: B,
    /// Bytes of the current message's 5-byte prefix seen so far, and the prefix.
    prefix: (usize, [u8; 5]),
    /// Bytes of the current message's body still to come.
    left: usize,
    /// Whole messages seen.
    messages: usize,
    /// The call takes exactly one request message (unary and server streaming).
    unary: bool,
    /// The request names a `grpc-encoding` (flag 1 is then tonic's to judge).
    compressed: bool,
    failed: bool,
}

impl<B> FramedBody<B> {
    /// Wraps `inner`, the body of a call that takes one message (`unary`) or a stream, whose
    /// request names a `grpc-encoding` (`compressed`).
    pub fn new(inner: B, unary: bool, compressed: bool) -> Self {
        FramedBody {
            inner,
            prefix: (0, [0; 5]),
            left: 0,
            messages: 0,
            unary,
            compressed,
            failed: false,
        }
    }

    /// Walks `data` through the framing.
    fn walk(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len());
                self.left -= n;
                data = &data[n..];
                if self.left == 0 {
                    self.messages += 1;
                }
                continue;
            }
            let (have, buf) = &mut self.prefix;
            buf[*have] = data[0];
            *have += 1;
            data = &data[1..];
            if *have == 1 && !(buf[0] == 0 || (buf[0] == 1 && self.compressed)) {
                return Err(framing_status(format!(
                    "a gRPC message's compression flag is {} (0, or 1 with a grpc-encoding)",
                    buf[0]
                )));
            }
            if *have == 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                *have = 0;
                if len == 0 {
                    self.messages += 1;
                } else {
                    self.left = len;
                }
            }
        }
        Ok(())
    }

    /// What is wrong with the framing at the end of the body, if anything.
    fn at_end(&self) -> Result<(), Status> {
        if self.prefix.0 > 0 || self.left > 0 {
            return Err(framing_status(
                "the request ends inside a gRPC message (its length prefix says more)".into(),
            ));
        }
        if self.unary && self.messages == 0 {
            return Err(framing_status(
                "the request has no message; this call takes one".into(),
            ));
        }
        Ok(())
    }
}

/// The path suffixes of the session API's client-streaming methods (every other method takes
/// one request message).
pub const CLIENT_STREAMS: &[&str] = &["/PutTensor", "/PutShardedTensor"];

/// A gRPC request with its body wrapped in [`FramedBody`]: a call whose path ends with one of
/// `client_streams` takes a stream of messages, any other exactly one. Every gRPC door of the
/// daemon (the session API, the inference door) layers its router with this.
pub fn framed_request(
    req: axum::extract::Request,
    client_streams: &[&str],
) -> axum::extract::Request {
    let path = req.uri().path();
    let unary = !client_streams.iter().any(|m| path.ends_with(m));
    let compressed = req.headers().contains_key("grpc-encoding");
    req.map(|b| axum::body::Body::new(FramedBody::new(b, unary, compressed)))
}

/// The trailer that carries the exact tpubox error kind: `grpc::ERROR_KIND_KEY`'s value,
/// which this module, below `grpc`, cannot name (checked by `grpc`'s tests).
pub(crate) const ERROR_KIND_KEY: &str = "tpubox-error-kind";

fn framing_status(message: String) -> Status {
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(
        ERROR_KIND_KEY,
        tonic::metadata::MetadataValue::from_static("invalid-argument"),
    );
    Status::with_metadata(tonic::Code::InvalidArgument, message, md)
}

impl<B> http_body::Body for FramedBody<B>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        use std::task::Poll;
        if self.failed {
            return Poll::Ready(None);
        }
        let fail = |this: &mut Self, s: Status| {
            this.failed = true;
            Poll::Ready(Some(Err(Box::new(s) as Self::Error)))
        };
        match std::pin::Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(s) = self.walk(data)
                {
                    return fail(&mut self, s);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => match self.at_end() {
                Ok(()) => Poll::Ready(None),
                Err(s) => fail(&mut self, s),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        // The end is where the framing is judged: never skip it.
        self.failed
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
