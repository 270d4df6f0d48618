"""gRPC plumbing shared by the gateway and the workers: generated protobuf
modules (built from protos/ by ``python -m rpc.build``), channel options and
the error interceptor. Torch-free."""
