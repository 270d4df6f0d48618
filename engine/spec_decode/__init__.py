"""Speculative decoding: a proposer guesses a few tokens, the target model
verifies them in one forward pass, and the engine keeps those it agrees with.

- base.py: the ``Proposer`` contract (a third method plugs in there).
- ngram.py: prompt lookup, no model.
- drafter.py: which sequences speculate each step, and auto-off.
- verify.py: greedy and rejection-sampling acceptance.
- stats.py: the counters behind ``vllm:spec_decode_*``.

The scheduler schedules ``1 + len(draft)`` tokens for a speculating decode
(token progress as ever: ``num_computed_tokens`` chases ``num_tokens``, the
proposal rides along in ``ScheduledRequest.draft_token_ids``), the runner
verifies, and ``Scheduler.update`` appends what was accepted and rolls the
rest back (engine/scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: imported lazily: engine/outputs.py (torch-free) reads stats.py
    from engine.config import SpeculativeConfig
    from engine.spec_decode.drafter import SpecDecoder


def make_spec_decoder(config: SpeculativeConfig | None, max_model_len: int) -> SpecDecoder | None:
    """The decoder ``config`` asks for, or None without speculation.
    ValueError for a method this engine cannot run."""
    from engine.spec_decode.drafter import SpecDecoder
    from engine.spec_decode.ngram import NgramProposer

    if config is None:
        return None
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        raise ValueError(f"speculative method {config.method!r} is not implemented yet")
    return SpecDecoder(config, proposer, max_model_len)

