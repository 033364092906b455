//! Generates the Open Inference Protocol's gRPC service `inference.GRPCInferenceService`
//! (`host/proto/grpc_service.proto`, server only) with tonic-prost-build. The proto is parsed
//! by protox, a protobuf compiler in Rust, so the build needs no `protoc` and downloads nothing.
//! The service decodes with `crate::grpc::BoundedCodec`, which bounds what a request may cost
//! decoded before prost decodes it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = "../../host/proto";
    let inference = "../../host/proto/grpc_service.proto";
    println!("cargo:rerun-if-changed={inference}");
    let fds = protox::compile([inference], [protos])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        // prost's codec behind a check of each request's wire format (src/grpc/bounds.rs).
        .codec_path("crate::grpc::BoundedCodec")
        .compile_fds(fds)?;
    Ok(())
}
