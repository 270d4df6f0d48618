"""Engine outputs as protobuf stream chunks."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from rpc.convert import logprobs_to_proto, set_stop_reason
from rpc.protos import common_pb2, worker_pb2


def to_chunk(out: RequestOutput, comp: CompletionOutput) -> worker_pb2.DecodeChunk:
    chunk = worker_pb2.DecodeChunk(
        token_ids=comp.delta_token_ids, text=comp.delta_text,
        finish_reason=comp.finish_reason or "",
    )
    set_stop_reason(chunk, comp.stop_reason)
    if comp.logprobs is not None and comp.delta_token_ids:
        new = comp.logprobs[len(comp.logprobs) - len(comp.delta_token_ids):]
        chunk.logprobs.extend(
            logprobs_to_proto(t, lp) for t, lp in zip(comp.delta_token_ids, new)
        )
    if comp.finished():
        chunk.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(comp.token_ids),
            cached_tokens=out.num_cached_tokens,
        ))
    return chunk


def prompt_logprobs_to_proto(out: RequestOutput) -> list[common_pb2.TokenLogprobs]:
    if out.prompt_logprobs is None:
        return []
    return [
        logprobs_to_proto(t, lp)
        for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])
    ]
