"""What prefill and decode workers share: the engine behind asyncio, the gRPC
servicer, Info/Abort, draining, and process start-up."""
