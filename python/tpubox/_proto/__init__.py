"""Generated protobuf and gRPC code of tpubox.v1.Session (host/proto/tpubox/v1/session.proto): do not edit; `bash scripts/dev.sh python-proto` regenerates it."""
