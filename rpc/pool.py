"""One channel per peer address, reused by every call to that peer."""

from __future__ import annotations

import grpc

from rpc.channel import aio_channel
from rpc.tls import TLSConfig


class ChannelPool:
    """``tls`` with a CA: every channel is mTLS (rpc/channel.py)."""

    def __init__(self, tls: TLSConfig | None = None) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self.tls)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
