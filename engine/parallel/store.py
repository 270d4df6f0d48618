"""A rendezvous TCPStore that listens on one address only.

NOTE: a master ``TCPStore`` binds every interface whatever host it is given
(the host only tells clients where to connect). A store anyone on the
network can write to lets them join or disturb the group, so the socket is
bound here, to ``host``, and handed to the store (which takes it over).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def listening_store(host: str, timeout: datetime.timedelta,
                    world_size: int | None = None) -> dist.TCPStore:
    """A master store on ``host`` at a port the system picks (``store.port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())
