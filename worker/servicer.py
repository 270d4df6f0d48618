"""The Worker gRPC service: protobuf in, a worker method, protobuf out."""

from __future__ import annotations

import grpc

from rpc.errors import TandemError
from rpc.logs import request_id_var
from rpc.protos import worker_pb2, worker_pb2_grpc


class Unimplemented(TandemError):
    code = grpc.StatusCode.UNIMPLEMENTED


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Delegates each RPC to the worker; a role that lacks a method answers
    UNIMPLEMENTED (a prefill worker does not decode)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def _method(self, name: str):
        fn = getattr(self.worker, name, None)
        if fn is None:
            raise Unimplemented(f"a {self.worker.role} worker does not serve {name}")
        return fn

    async def Info(self, request, context):
        return await self.worker.info()

    async def Reserve(self, request, context):
        request_id_var.set(request.request_id)
        return worker_pb2.ReserveResponse(ticket=await self._method("reserve")(request))

    async def Prefill(self, request, context):
        request_id_var.set(request.request_id)
        return await self._method("prefill")(request)

    async def Decode(self, request, context):
        request_id_var.set(request.request_id)
        async for chunk in self._method("decode")(request):
            yield chunk

    async def Abort(self, request, context):
        request_id_var.set(request.request_id)
        return worker_pb2.AbortResponse(found=await self.worker.abort(request.request_id))

    async def PushKV(self, request_iterator, context):
        received = await self._method("receive_grpc")(request_iterator)
        return worker_pb2.PushKVResponse(bytes_received=received)

    async def ExpectKV(self, request, context):
        request_id_var.set(request.request_id)
        received = await self._method("receive_torch")(request)
        return worker_pb2.PushKVResponse(bytes_received=received)

    async def OpenTransferGroup(self, request, context):
        await self._method("open_group")(request)
        return worker_pb2.OpenTransferGroupResponse()

    async def Preflight(self, request_iterator, context):
        received = await self._method("receive_preflight")(request_iterator)
        return worker_pb2.PushKVResponse(bytes_received=received)
