//! Generates the Open Inference Protocol's gRPC service `inference.GRPCInferenceService`
//! (`host/proto/grpc_service.proto`, server only) with tonic-prost-build, and compiles Triton's
//! own `host/proto/triton/model_config.proto` into a descriptor set (`model_config.fds` in
//! `OUT_DIR`) that `triton_schema.rs` embeds, to read `config.pbtxt` files against it. The
//! protos are parsed by protox, a protobuf compiler in Rust, so the build needs no `protoc` and
//! downloads nothing. The service decodes with `crate::grpc::BoundedCodec`, which bounds what a
//! request may cost decoded before prost decodes it.

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

    let triton = "../../host/proto/triton";
    let model_config = "../../host/proto/triton/model_config.proto";
    println!("cargo:rerun-if-changed={model_config}");
    let encoded = protox::Compiler::new([triton])?
        .include_imports(true)
        .open_files([model_config])?
        .encode_file_descriptor_set();
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("model_config.fds");
    std::fs::write(out, encoded)?;
    Ok(())
}
