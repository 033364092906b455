//! Generates the session API's gRPC service `tpubox.v1.Session`
//! (`host/proto/tpubox/v1/session.proto`, server and client: the client is what the Rust tests
//! and benchmarks drive it with) with tonic-prost-build. The proto is parsed by protox, a
//! protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = "../../host/proto";
    let session = "../../host/proto/tpubox/v1/session.proto";
    println!("cargo:rerun-if-changed={session}");
    let fds = protox::compile([session], [protos])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Tensor data and programs as `bytes::Bytes`: chunks are slices, not copies.
        .bytes(".tpubox.v1")
        // Decode errors as INVALID_ARGUMENT (tonic's default codec answers INTERNAL).
        .codec_path("crate::codec::Codec")
        .compile_fds(fds)?;
    Ok(())
}
