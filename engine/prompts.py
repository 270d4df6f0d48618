"""What a caller's prompt and parameters become before the engine checks
them: the prompt's text and token ids (a string, token ids, or vLLM's
``{"prompt": text}`` / ``{"prompt_token_ids": ids}``), ``max_tokens=None``
as a number, and ``bad_words`` as token ids. Torch-free; ValueError for
what cannot be read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Mapping[str, Any]


def tokenize(tokenizer: Tokenizer | None, prompt: Prompt) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and its token ids."""
    if isinstance(prompt, Mapping):
        prompt = _prompt_of(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return prompt, tokenizer.encode(prompt)
    return None, prompt_token_ids(prompt)


def prompt_token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids, as a list; ValueError if it is not one."""
    if not isinstance(prompt, Sequence) or isinstance(prompt, str):
        # e.g. LLM.generate([1.5]): a TypeError otherwise
        raise ValueError(
            f"a prompt must be a string or a list of integer token ids, "
            f"got {type(prompt).__name__}"
        )
    token_ids = list(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError("prompt token ids must be integers")
    return token_ids


def _prompt_of(prompt: Mapping[str, Any]) -> str | list[int]:
    """The text or token ids of a vLLM-style prompt dict (``TextPrompt`` /
    ``TokensPrompt``); ValueError for any other shape."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return prompt_token_ids(prompt["prompt_token_ids"])
    raise ValueError("a prompt dict must be {'prompt': text} or {'prompt_token_ids': ids}, "
                     f"got keys {sorted(keys)}")


def with_max_tokens(params: SamplingParams, prompt_len: int,
                    max_model_len: int) -> SamplingParams:
    """``params`` with ``max_tokens=None`` (as many as the context has room
    for after the prompt, as in vLLM) made a number. The first look at a
    request's params: ValueError if they are not a SamplingParams."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.max_tokens is not None:
        return params
    return dataclasses.replace(params, max_tokens=context_room(prompt_len, max_model_len))


def context_room(prompt_len: int, max_model_len: int) -> int:
    """How many tokens the context has room for after a prompt (at least 1:
    a prompt that fills it is refused by the length check, not here)."""
    return max(1, max_model_len - prompt_len)


def bad_word_ids(tokenizer: Tokenizer | None, words: list[str]) -> list[list[int]]:
    """Each word's tokens as it starts the text and after a space (vLLM's two)."""
    if tokenizer is None:
        raise ValueError("bad_words need the model's tokenizer (tokenizer.json)")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
