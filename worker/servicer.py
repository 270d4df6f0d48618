"""The Worker gRPC service: protobuf in, a worker method, protobuf out.

Every method is the worker's own; a role answers UNIMPLEMENTED for what it
does not serve (``WorkerBase``'s defaults), and ``ErrorInterceptor`` maps
what any of them raises to a status.
"""

from __future__ import annotations

from rpc.logs import request_id_var
from rpc.protos import worker_pb2, worker_pb2_grpc
from worker.base import WorkerBase
from worker.decode_many import decode_many


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker

    async def Info(self, request, context):
        return await self.worker.info()

    async def Reserve(self, request, context):
        request_id_var.set(request.request_id)
        return worker_pb2.ReserveResponse(ticket=await self.worker.reserve(request))

    async def Prefill(self, request, context):
        request_id_var.set(request.request_id)
        return await self.worker.prefill(request)

    async def Decode(self, request, context):
        request_id_var.set(request.request_id)
        async for chunk in self.worker.decode(request):
            yield chunk

    async def DecodeMany(self, request_iterator, context):
        async for batch in decode_many(self.worker, request_iterator):
            yield batch

    async def Abort(self, request, context):
        request_id_var.set(request.request_id)
        return worker_pb2.AbortResponse(found=await self.worker.abort(request.request_id))

    async def PushKV(self, request_iterator, context):
        received = await self.worker.receive_grpc(request_iterator)
        return worker_pb2.PushKVResponse(bytes_received=received)

    async def OpenTransferGroup(self, request, context):
        await self.worker.open_group(request)
        return worker_pb2.OpenTransferGroupResponse()

    async def KVFrames(self, request_iterator, context):
        await self.worker.receive_frames(request_iterator)
        return
        yield  # NOTE: unreachable; a bidirectional stream that answers nothing

    async def Preflight(self, request_iterator, context):
        received = await self.worker.receive_preflight(request_iterator)
        return worker_pb2.PushKVResponse(bytes_received=received)

    async def WriteKV(self, request_iterator, context):
        async for reply in self.worker.receive_writes(request_iterator):
            yield reply
