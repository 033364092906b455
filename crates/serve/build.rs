//! Generates the Open Inference Protocol's gRPC service `inference.GRPCInferenceService`
//! (`host/proto/grpc_service.proto`, server only) with tonic-prost-build. The proto is parsed
//! by protox, a protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = "../../host/proto";
    let inference = "../../host/proto/grpc_service.proto";
    println!("cargo:rerun-if-changed={inference}");
    let fds = protox::compile([inference], [protos])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
