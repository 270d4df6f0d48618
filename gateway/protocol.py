"""OpenAI request bodies, and their translation to SamplingParams.

Field names and defaults follow OpenAI's API; vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, ...) are accepted too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from engine.config import default_of
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.tokenizer import ChatOptions, content_text
from gateway.structured import InvalidField

_TOKEN_ID = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit also takes "²" and "٣"


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk too


# The fields a model's generation_config.json may give defaults for (a
# request's null is unset too), and their own defaults (SamplingParams').
_BUILT_IN = {name: default_of(SamplingParams, name)
             for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # NOTE: StrictInt where a JSON true would otherwise pass as 1 (n, seed,
    # token ids...): a client that sends a boolean there has a bug to hear of.
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # OpenAI's: token ids (as strings, JSON's keys) -> a bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output constraints (gateway/structured.py): OpenAI's, vLLM's newer and older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the completion's token ids (and the prompt's) in the response.
    return_token_ids: bool = False
    # vLLM's: each prompt token's logprob, with this many most likely tokens
    # at its position, in the response; not with stream.
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    def sampling(self, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None,
                 structured_outputs: StructuredOutputsParams | None = None,
                 defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError with the same messages as the Python API.
        ``defaults``: the model's sampling defaults (engine/generation_config.py),
        for the fields this request leaves unset."""
        model = {k: v for k, v in (defaults or {}).items() if k in _BUILT_IN}
        given = {k: getattr(self, k) for k in _BUILT_IN if getattr(self, k) is not None}
        self.check_fields()
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            **{**_BUILT_IN, **model, **given}, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=structured_outputs,
            logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )

    def check_fields(self) -> None:
        """InvalidField for fields that make no sense together."""
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options need stream: true")

    def prompt_logprobs_with(self, echoed: int | None = None) -> int | None:
        """The engine's ``prompt_logprobs``: this request's, or ``echoed``
        (an echo's with logprobs) if more."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidField("prompt_logprobs", "prompt_logprobs are not available with "
                                                  "stream: true")
        asked = [n for n in (self.prompt_logprobs, echoed) if n is not None]
        return max(asked) if asked else None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise InvalidField("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        """Plain text content; a list of parts must be text parts only."""
        return content_text(self.content)


class ChatRendering(BaseModel):
    """How chat messages become the prompt: vLLM's chat template fields."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_options(self) -> ChatOptions:
        """The fields as ChatOptions; InvalidField naming the one at fault."""
        try:
            return ChatOptions.of(self.add_generation_prompt, self.continue_final_message,
                                  self.chat_template_kwargs)
        except ValueError as exc:
            field = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") \
                else "continue_final_message"
            raise InvalidField(field, str(exc)) from None


class ChatCompletionRequest(_Common, ChatRendering):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs need logprobs: true")


class TokenizeRequest(ChatRendering):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]
