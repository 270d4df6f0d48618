"""Moving a prompt's KV blocks from a prefill worker to a decode worker.

One interface (``KVSender`` on the prefill side, ``KVReceiver`` on the decode
side), a versioned wire header (``KVLayout``) checked at handshake, and two
transports: ``grpc`` (chunked bytes, works anywhere) and ``torch``
(torch.distributed: gloo on CPU, NCCL on CUDA). RDMA would be a third
``KVSender`` and a receiver hook.
"""
