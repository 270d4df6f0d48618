"""Whether a request can be served: one check for every front end.

Torch-free, so the gateway runs the same check the engine does (REST, gRPC,
the workers' RPCs and ``LLM`` all end here), with one wording for each
failure. ``SamplingParams`` checks its own fields when it is built; this
checks a request against a model: its prompt and the context it needs.
A failure is a ValueError, raised before anything is queued or allocated.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams


def check_request(token_ids: list[int], params: SamplingParams, model: ModelConfig,
                  max_model_len: int, max_n: int) -> None:
    """ValueError unless ``token_ids`` (the prompt) with ``params`` fits a
    model served with ``max_model_len`` tokens of context and ``max_n``
    completions per request."""
    total = len(token_ids) + params.max_tokens
    if total <= max_model_len:  # NOTE: the length first: it is cheap, the ids' check is not
        model.check_prompt(token_ids)
    else:
        # NOTE: OpenAI's wording (clients parse it), and the setting's name.
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). "
            f"However, you requested {total} tokens ({len(token_ids)} in the prompt, "
            f"{params.max_tokens} for the completion)."
        )
    if params.n > max_n:
        raise ValueError(f"n must be at most {max_n}, got {params.n}")
    if len(params.allowed_token_ids or ()) > model.vocab_size:
        raise ValueError(f"allowed_token_ids has {len(params.allowed_token_ids)} entries, more "
                         f"than the vocabulary's {model.vocab_size} tokens")
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= model.vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {model.vocab_size})")
