"""Protobuf <-> Python conversions shared by the gateway and the workers."""

from __future__ import annotations

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from rpc.protos import common_pb2


def params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError for invalid values, like the Python API."""
    return SamplingParams(
        n=p.n or 1,
        max_tokens=p.max_tokens or 16,
        min_tokens=p.min_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else -1,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        structured_outputs=StructuredOutputsParams.from_wire(p.structured_outputs.kind,
                                                             p.structured_outputs.value)
        if p.HasField("structured_outputs") else None,
        logit_bias=dict(p.logit_bias) or None,
        allowed_token_ids=list(p.allowed_token_ids) or None,
        bad_words=list(p.bad_words) or None,
    )


def params_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        n=s.n, max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, stop=s.stop, stop_token_ids=s.stop_token_ids,
        include_stop_str_in_output=s.include_stop_str_in_output, ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.logit_bias:
        p.logit_bias.update(s.logit_bias)
    if s.allowed_token_ids is not None:
        p.allowed_token_ids.extend(s.allowed_token_ids)
    if s.bad_words:
        p.bad_words.extend(s.bad_words)
    if s.structured_outputs is not None:
        kind, value = s.structured_outputs.to_wire()
        p.structured_outputs.kind, p.structured_outputs.value = kind, value
    return p


def set_stop_reason(msg, reason: int | str | None) -> None:
    """Put what ended a completion, a stop token id or a stop string (None:
    neither), into a ``PrefillResponse`` or ``DecodeChunk``."""
    if isinstance(reason, int):
        msg.stop_token_id = reason
    elif reason is not None:
        msg.stop_reason = reason


def stop_reason_from_proto(msg) -> int | str | None:
    """The inverse of ``set_stop_reason``."""
    if msg.HasField("stop_token_id"):
        return msg.stop_token_id
    return msg.stop_reason or None


def logprobs_to_proto(token_id: int, entry: dict[int, float] | None) -> common_pb2.TokenLogprobs:
    """``entry`` holds the chosen token and the top-N, best first after it."""
    if entry is None:
        return common_pb2.TokenLogprobs(token_id=token_id)
    top = [(t, v) for t, v in entry.items()]
    top.sort(key=lambda kv: -kv[1])
    return common_pb2.TokenLogprobs(
        token_id=token_id, logprob=entry.get(token_id, 0.0),
        top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top],
        rank=_rank(entry.get(token_id)), top_ranks=[_rank(v) for _, v in top],
    )


def _rank(value) -> int:
    """An engine ``Logprob``'s rank; 0 where not known."""
    return getattr(value, "rank", None) or 0


def logprobs_from_proto(lp: common_pb2.TokenLogprobs) -> dict[int, Logprob]:
    """The inverse of ``logprobs_to_proto``, ranks included (None where not known)."""
    out = {lp.token_id: Logprob(lp.logprob, lp.rank or None)}
    ranks = list(lp.top_ranks) or [0] * len(lp.top_token_ids)
    for t, v, rank in zip(lp.top_token_ids, lp.top_logprobs, ranks):
        out.setdefault(t, Logprob(v, rank or None))
    return out
