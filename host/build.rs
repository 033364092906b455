//! Generates the gRPC services with tonic-prost-build: the Open Inference Protocol's
//! `inference.GRPCInferenceService` (`proto/grpc_service.proto`, server only) and the session
//! API `tpubox.v1.Session` (`proto/tpubox/v1/session.proto`, server and client: the client is
//! what the Rust tests and benchmarks drive it with). The protos are parsed by protox, a
//! protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let inference = "proto/grpc_service.proto";
    let session = "proto/tpubox/v1/session.proto";
    println!("cargo:rerun-if-changed={inference}");
    println!("cargo:rerun-if-changed={session}");
    let fds = protox::compile([inference], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    let fds = protox::compile([session], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Tensor data and programs as `bytes::Bytes`: chunks are slices, not copies.
        .bytes(".tpubox.v1")
        .compile_fds(fds)?;
    Ok(())
}
