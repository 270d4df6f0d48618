"""Speculative decoding: a proposer guesses a few tokens, the target model
verifies them in one forward pass, and the engine keeps those it agrees with.

- base.py: the ``Proposer`` contract (a third method plugs in there).
- ngram.py: prompt lookup, no model.
- draft.py: a smaller model of the same tokenizer, in an engine of its own.
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
    from engine.config import EngineConfig, ModelConfig
    from engine.spec_decode.drafter import SpecDecoder


def make_spec_decoder(engine_config: EngineConfig, model_config: ModelConfig,
                      max_model_len: int) -> SpecDecoder | None:
    """The decoder ``engine_config.speculative_config`` asks for, or None
    without speculation. ValueError for a draft that cannot serve this
    target (another vocabulary, larger, shorter context)."""
    from engine.spec_decode.drafter import SpecDecoder

    config = engine_config.speculative_config
    if config is None:
        return None
    if config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from engine.spec_decode.draft import DraftModelProposer

        proposer = DraftModelProposer(engine_config, model_config, max_model_len)
    return SpecDecoder(config, proposer, max_model_len, engine_config.device)

