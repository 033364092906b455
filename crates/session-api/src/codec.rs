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

impl<U: Message + Default> Decoder for InvalidArgumentDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|e| {
            Status::invalid_argument(format!(
                "the message is not a valid {}: {}",
                std::any::type_name::<U>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("message"),
                e.message()
            ))
        })
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
