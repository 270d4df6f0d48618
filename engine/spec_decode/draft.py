"""Draft-model proposals: a smaller model of the same tokenizer guesses the
next tokens greedily.

The draft runs in an engine of its own (its weights, its paged KV cache, its
scheduler), driven through ``LLMEngine``'s public API like any caller: each
step every speculating sequence is added to it as a request whose prompt is
the sequence so far, with ``max_tokens`` = the tokens to propose, and the
draft engine steps until they finish. That looks like a re-prefill per
step, but the draft engine caches prefixes: the full blocks computed for a
sequence in the previous step (prompt, accepted tokens) are found again, so
each step computes only the tail past the last full block and the new
tokens, then ``max_tokens`` greedy decodes. Rejected guesses need no
rollback here: they were never in a prompt, and their blocks were freed
when the draft request finished. A sequence's first proposal computes its
whole context in the draft (on a decode worker: the draft's prompt KV is
computed locally; see docs/architecture.md).

Greedy drafting makes each guess a point mass, so the verifier's rule for
``probs=None`` is the exact one (engine/spec_decode/verify.py).
"""

from __future__ import annotations

import dataclasses
import itertools

from engine.config import EngineConfig, ModelConfig
from engine.spec_decode.base import DraftRequest, Proposal, Proposer

_GREEDY = dict(temperature=0.0, ignore_eos=True)


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, target: EngineConfig, target_model: ModelConfig,
                 target_max_model_len: int) -> None:
        from engine.llm_engine import LLMEngine  # NOTE: here: llm_engine imports this package
        from engine.sampling_params import SamplingParams

        spec = target.speculative_config
        if target.tensor_parallel_size != 1:
            raise ValueError("draft-model speculation runs with tensor_parallel_size 1 only")
        cache = dataclasses.replace(target.cache, enable_prefix_caching=True)
        config = dataclasses.replace(
            target, model=spec.model, speculative_config=None, cache=cache,
            scheduler=dataclasses.replace(target.scheduler, max_n=1),
        )
        self.engine = LLMEngine(config)
        check_draft(self.engine.model_config, target_model)
        if self.engine.max_model_len < target_max_model_len:
            raise ValueError(
                f"the draft model's context ({self.engine.max_model_len}) is shorter than "
                f"the target's ({target_max_model_len})"
            )
        self._params = SamplingParams
        self._ids = itertools.count()

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        engine = self.engine
        ids = {}
        for r in requests:
            rid = f"draft-{next(self._ids)}"
            ids[rid] = r.request_id
            engine.add_request(rid, r.token_ids, self._params(max_tokens=r.max_tokens, **_GREEDY))
        tokens: dict[str, list[int]] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens[ids[out.request_id]] = out.outputs[0].token_ids
        except BaseException:
            # A failed draft step: leave no draft request behind (the next
            # proposal would meet its outputs) and no prefix it may not have written.
            engine.abort_request([rid for rid in ids if engine.has_request(rid)])
            engine.reset_prefix_cache()
            raise
        return [Proposal(tokens.get(r.request_id, [])) for r in requests]


def check_draft(draft: ModelConfig, target: ModelConfig) -> None:
    """ValueError unless ``draft`` can propose for ``target``: the same
    vocabulary, and not larger (it would cost more than it saves)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
            f"target's ({target.vocab_size}): they must share a tokenizer"
        )
    if _size(draft) > _size(target):
        raise ValueError(
            f"the draft model (~{_size(draft) / 1e6:.1f}M parameters) is larger than the "
            f"target (~{_size(target) / 1e6:.1f}M)"
        )


def _size(m: ModelConfig) -> int:
    """Parameters of the decoder layers (attention and MLP), roughly."""
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * (attn + mlp) + m.vocab_size * m.hidden_size
