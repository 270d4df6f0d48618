"""The gateway: OpenAI-compatible REST and the public gRPC Generate stream in
front of prefill and decode workers. Torch-free, so it starts fast."""
