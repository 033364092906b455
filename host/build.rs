//! Generates the gRPC service (`inference.GRPCInferenceService`) from
//! `proto/grpc_service.proto` with tonic-prost-build. The proto is parsed by protox, a
//! protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/grpc_service.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
