"""Moving a prompt's KV blocks from a prefill worker to a decode worker.

One interface (``KVSender`` on the prefill side, ``KVReceiver`` on the decode
side), a versioned wire header (``KVLayout``) checked at handshake, and three
transports: ``grpc`` (chunked bytes, works anywhere), ``torch``
(torch.distributed: gloo on CPU, NCCL on CUDA) and ``mooncake`` (the Mooncake
Transfer Engine's one-sided writes into the decode worker's registered
cache, TCP or RDMA).
"""
