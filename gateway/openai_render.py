"""OpenAI response bodies and stream chunks, built from the gateway's chunks:
``collect`` for a JSON response, ``stream`` for server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from gateway.sequence import Chunk
from gateway.service import GatewayService
from gateway.tool_parsers import Named, ToolCallStream, finished_calls


class Renderer:
    object_name = ""
    chunk_object = ""

    def __init__(self, service: GatewayService, rid: str, num_choices: int,
                 prompts: list[list[int]], return_token_ids: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        """``prompts``: each prompt's token ids. ``return_token_ids``: vLLM's, each
        choice's token ids (and its prompt's) in the response.
        ``prompt_logprobs``: vLLM's, the prompt's logprobs in a collected
        response, with this many top tokens at each position."""
        self.service = service
        self.prompt_logprobs = prompt_logprobs
        self._scored: dict[int, list] = {}  # prompt -> its tokens' logprobs (TokenLogprobs)
        self._texts: dict[int, str] = {}  # token id -> its text, decoded once a request
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes, once a request
        self._prompt_entries: dict[int, list] = {}  # prompt -> its vLLM prompt_logprobs
        self.prompts = prompts
        self.return_token_ids = return_token_ids
        self.rid = rid
        self.created = int(time.time())
        self.num_choices = num_choices
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def _account(self, prompt_index: int, chunk: Chunk) -> None:
        if chunk.prompt_logprobs:
            self._scored[prompt_index] = list(chunk.prompt_logprobs)
        self.completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason:
            self.prompt_tokens[prompt_index] = chunk.prompt_tokens
            self.cached_tokens[prompt_index] = chunk.cached_tokens

    def usage(self) -> dict:
        """So far: a prompt still generating counts its tokens as sent."""
        prompt = sum(self.prompt_tokens.get(i, len(p)) for i, p in enumerate(self.prompts))
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    @staticmethod
    def stop_reason(chunk: Chunk) -> int | str | None:
        """What stopped the completion, as vLLM reports it: the stop string,
        the stop token id, or None (EOS, length, not finished)."""
        return chunk.stop_reason if chunk.finish_reason else None

    async def vllm_prompt_logprobs(self, p: int) -> list[dict | None]:
        """Prompt ``p``'s logprobs as vLLM's ``prompt_logprobs``: per token
        (the first None), its own and the ``prompt_logprobs`` most likely
        tokens', by token id: logprob, rank in the vocabulary, text. Built
        once per prompt, off the event loop (a prompt can be long)."""
        if p not in self._prompt_entries:
            self._prompt_entries[p] = await self.service.off_loop(self._prompt_entries_of, p)
        return self._prompt_entries[p]

    def _prompt_entries_of(self, p: int) -> list[dict | None]:
        out: list[dict | None] = [None]
        for lp in self._scored.get(p, []):
            entry = {str(lp.token_id): self._scored_token(lp.token_id, lp.logprob, lp.rank)}
            for t, v, rank in top_entries(lp, self.prompt_logprobs):
                entry.setdefault(str(t), self._scored_token(t, v, rank))
            out.append(entry)
        return out

    def _scored_token(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank or None,
                "decoded_token": self.token_text(token_id)}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.service.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """Its own bytes, also where they are part of a character split over
        tokens (``token_text`` is U+FFFD there)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self.service.tokenizer.token_bytes(token_id)
        return raw

    async def _all(self, first, merged):
        if first is not None:
            yield first
            async for item in merged:
                yield item

    def _envelope(self, choices: list, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created,
                "model": self.service.model_name, "choices": choices}

    def _extend(self, choice: dict, logprobs: dict | None, chunk: Chunk) -> None:
        """Fold one chunk's logprobs (lists under each key), finish and stop
        reason into a choice being collected."""
        if logprobs is not None:
            if choice["logprobs"] is None:
                choice["logprobs"] = logprobs
            else:
                for key, values in logprobs.items():
                    choice["logprobs"][key].extend(values)
        if chunk.finish_reason:
            choice["finish_reason"] = chunk.finish_reason
            choice["stop_reason"] = self.stop_reason(chunk)

    def _with_usage(self, chunk: dict, continuous: bool) -> dict:
        """A stream chunk, with the usage so far where vLLM's
        ``continuous_usage_stats`` asked for it in every chunk."""
        if continuous:
            chunk["usage"] = self.usage()
        return chunk

    def _collected(self, choices: dict[int, dict], obj: str) -> dict:
        body = self._envelope([choices[i] for i in sorted(choices)], obj)
        body["usage"] = self.usage()
        return body


def top_entries(lp, n: int) -> list[tuple[int, float, int]]:
    """``lp``'s top tokens as (id, logprob, rank): the token itself and those
    of rank ``n`` or better. NOTE: by rank, since the engine may have kept
    more than a choice asked for (``prompt_logprobs`` and an echo's
    ``logprobs`` share one count); a rank not known (0) is kept."""
    ranks = list(lp.top_ranks) or [0] * len(lp.top_token_ids)
    return [(t, v, rank) for t, v, rank in zip(lp.top_token_ids, lp.top_logprobs, ranks)
            if t == lp.token_id or not rank or rank <= n]


class TokenOffsets:
    """Where each token starts in a text, in characters (OpenAI's
    ``text_offset``), read off the text as the workers decode it: a token
    that holds part of a character starts where the character does; one
    whose text came out behind such a part that never completed starts at
    its own text."""

    def __init__(self, renderer: Renderer, context: list[int], skip_special_tokens: bool,
                 base: int = 0) -> None:
        """``context``: the tokens before (a prompt); ``base``: the text's
        length before the first token added."""
        self.renderer = renderer
        self.text = IncrementalDetokenizer(renderer.service.tokenizer, context,
                                           skip_special_tokens=skip_special_tokens)
        self.base = base
        self.pending = 0  # tokens added since the text last grew

    def add(self, token_id: int) -> int:
        """The next token's offset."""
        before = len(self.text.text)
        self.text.add(token_id)
        after = len(self.text.text)
        own = self.renderer.token_text(token_id)
        start = before
        if (self.pending and own and "\ufffd" not in own and len(own) < after - before
                and self.text.text.endswith(own)):
            start = after - len(own)
        self.pending = 0 if after > before else self.pending + 1
        return self.base + start


class CompletionRenderer(Renderer):
    def __init__(self, service, rid, prompts: list[list[int]], n: int, top_n: int,
                 return_token_ids: bool = False, echo: list[str] | None = None,
                 prompt_logprobs: int | None = None, skip_special_tokens: bool = True,
                 prompt_only: bool = False) -> None:
        """``echo``: each prompt's text, put before its completions (with the
        prompt's logprobs, when asked: the first token's is None).
        ``skip_special_tokens``: the request's, for where tokens start in
        its text (``text_offset``). ``prompt_only``: echo with max_tokens 0,
        the generated token left out of every choice (finish_reason length)."""
        super().__init__(service, rid, len(prompts) * n, prompts, return_token_ids,
                         prompt_logprobs)
        self.n = n
        self.top_n = top_n
        self.skip_special_tokens = skip_special_tokens
        # choice -> where its completion's tokens start in its text
        self.offsets: dict[int, TokenOffsets] = {}
        self.echo = echo
        self._heads: dict[int, dict] = {}  # prompt -> its echoed logprobs
        self._started: set[int] = set()
        self.prompt_only = prompt_only

    async def _chunks(self, first, merged):
        async for p, chunk in self._all(first, merged):
            if self.prompt_only:
                chunk = replace(chunk, token_ids=[], text="", logprobs=[], stop_reason=None,
                                finish_reason="length" if chunk.finish_reason else None)
            yield p, chunk

    async def _open(self, p: int, choice: int, chunk: Chunk) -> tuple[str, dict | None, bool]:
        """A chunk's text and logprobs, the prompt's before them in the
        first chunk of each choice under ``echo``; and whether it is the
        choice's first chunk."""
        first = choice not in self._started
        self._started.add(choice)
        if self.echo is None or not first:
            return chunk.text, self._logprobs(choice, chunk), first
        text = self.echo[p]
        if not (chunk.logprobs or (self.prompt_only and p in self._scored)):
            return text + chunk.text, None, first
        if p not in self._heads:  # once per prompt, off the event loop: it can be long
            self._heads[p] = await self.service.off_loop(self._echo_head, p)
        head = {key: list(values) for key, values in self._heads[p].items()}
        for key, values in (self._logprobs(choice, chunk) or {}).items():
            head[key].extend(values)
        return text + chunk.text, head, first

    def _echo_head(self, p: int) -> dict:
        """The prompt's tokens as the first logprobs of its choices (the
        first token's logprob None)."""
        ids = self.prompts[p]
        scored = [None, *self._scored.get(p, [])]
        head: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offsets = TokenOffsets(self, [], skip_special_tokens=False)
        for token, lp in zip(ids, scored + [None] * (len(ids) - len(scored))):
            head["text_offset"].append(offsets.add(token))
            head["tokens"].append(self.token_text(token))
            head["token_logprobs"].append(None if lp is None else lp.logprob)
            head["top_logprobs"].append(None if lp is None else {
                self.token_text(t): v for t, v, _ in top_entries(lp, self.top_n)})
        return head

    def _logprobs(self, choice: int, chunk: Chunk) -> dict | None:
        if not chunk.logprobs:
            return None
        tokens, values, tops, offsets = [], [], [], []
        if choice not in self.offsets:
            p = choice // self.n
            self.offsets[choice] = TokenOffsets(
                self, self.prompts[p], self.skip_special_tokens,
                base=len(self.echo[p]) if self.echo is not None else 0)
        for lp in chunk.logprobs:
            offsets.append(self.offsets[choice].add(lp.token_id))
            tokens.append(self.token_text(lp.token_id))
            values.append(lp.logprob)
            # The top ``logprobs`` and the sampled token, as OpenAI's
            # completions give them (so up to logprobs + 1 entries).
            tops.append({self.token_text(t): v for t, v in zip(lp.top_token_ids,
                                                                lp.top_logprobs)})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    async def stream(self, first, merged, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[dict]:
        async for p, chunk in self._chunks(first, merged):
            self._account(p, chunk)
            choice = p * self.n + chunk.index
            text, logprobs, opens = await self._open(p, choice, chunk)
            body = {
                "index": choice, "text": text, "logprobs": logprobs,
                "finish_reason": chunk.finish_reason, "stop_reason": self.stop_reason(chunk),
            }
            if self.return_token_ids:
                body["token_ids"] = list(chunk.token_ids)
                if opens:
                    body["prompt_token_ids"] = self.prompts[p]
            yield self._with_usage(self._envelope([body], "text_completion"), continuous_usage)
        if include_usage:
            yield {**self._envelope([], "text_completion"), "usage": self.usage()}

    async def collect(self, first, merged) -> dict:
        choices: dict[int, dict] = {}
        async for p, chunk in self._chunks(first, merged):
            self._account(p, chunk)
            index = p * self.n + chunk.index
            c = choices.setdefault(index, {"index": index, "text": "", "logprobs": None,
                                           "finish_reason": None, "stop_reason": None})
            text, logprobs, _ = await self._open(p, index, chunk)
            c["text"] += text
            if self.return_token_ids:
                c.setdefault("prompt_token_ids", self.prompts[p])
                c.setdefault("token_ids", []).extend(chunk.token_ids)
            self._extend(c, logprobs, chunk)
        if self.prompt_logprobs is not None:
            for index, c in choices.items():
                c["prompt_logprobs"] = await self.vllm_prompt_logprobs(index // self.n)
        return self._collected(choices, "text_completion")


class ChatRenderer(Renderer):
    def __init__(self, service, rid, prompt: list[int], n: int, top_n: int, tool_parser=None,
                 tool_names: frozenset[str] | None = None,
                 return_token_ids: bool = False, prompt_logprobs: int | None = None) -> None:
        super().__init__(service, rid, n, [prompt], return_token_ids, prompt_logprobs)
        self.top_n = top_n
        # Finds tool calls in each choice's text (gateway/tool_parsers.py); None: no tools.
        self.tool_parser = tool_parser
        self.tool_names = tool_names  # the functions a call may name (None: any)
        # finish_reason "tool_calls" where the model chose to call (auto,
        # required); a call forced by name ends with "stop", as OpenAI's does.
        self.calls_end_turn = not isinstance(tool_parser, Named)

    def _logprobs(self, chunk: Chunk) -> dict | None:
        if not chunk.logprobs:
            return None
        content = []
        for lp in chunk.logprobs:
            content.append({
                **self._entry(lp.token_id, lp.logprob),
                "top_logprobs": [
                    self._entry(tid, v)
                    for tid, v in list(zip(lp.top_token_ids, lp.top_logprobs))[: self.top_n]
                ],
            })
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        """A token's text, logprob and bytes (its own, also where they are
        part of a character split over tokens: the text is U+FFFD there)."""
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self.token_bytes(token_id))}

    async def stream(self, first, merged, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[dict]:
        started: set[int] = set()
        tools: dict[int, tuple[ToolCallStream, list[str]]] = {}
        async for p, chunk in self._all(first, merged):
            self._account(p, chunk)
            delta: dict[str, Any] = {}
            envelope: dict[str, Any] = {}
            if chunk.index not in started:
                started.add(chunk.index)
                delta["role"] = "assistant"
                if self.return_token_ids:
                    envelope["prompt_token_ids"] = self.prompts[0]
            text, reason = chunk.text, chunk.finish_reason
            if self.tool_parser is not None:
                calls, texts = tools.setdefault(chunk.index, (
                    ToolCallStream(self.tool_parser, self.tool_names), []))
                texts.append(chunk.text)
                text, entries = calls.feed("".join(texts), final=bool(reason))
                if entries:
                    delta["tool_calls"] = entries
                if reason == "stop" and calls.called and calls.complete and self.calls_end_turn:
                    reason = "tool_calls"
            if text or not delta:
                delta["content"] = text
            body = {"index": chunk.index, "delta": delta, "logprobs": self._logprobs(chunk),
                    "finish_reason": reason, "stop_reason": self.stop_reason(chunk)}
            if self.return_token_ids:
                body["token_ids"] = list(chunk.token_ids)
            yield self._with_usage({**self._envelope([body], "chat.completion.chunk"),
                                    **envelope}, continuous_usage)
        if include_usage:
            yield {**self._envelope([], "chat.completion.chunk"), "usage": self.usage()}

    async def collect(self, first, merged) -> dict:
        choices: dict[int, dict] = {}
        async for p, chunk in self._all(first, merged):
            self._account(p, chunk)
            c = choices.setdefault(chunk.index, {
                "index": chunk.index, "message": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None, "stop_reason": None,
            })
            c["message"]["content"] += chunk.text
            if self.return_token_ids:
                c.setdefault("token_ids", []).extend(chunk.token_ids)
            self._extend(c, self._logprobs(chunk), chunk)
        if self.tool_parser is not None:
            for c in choices.values():
                message = c["message"]
                message["content"], calls, complete = finished_calls(
                    self.tool_parser, message["content"], self.tool_names)
                if calls:
                    message["tool_calls"] = calls
                    if c["finish_reason"] == "stop" and complete and self.calls_end_turn:
                        c["finish_reason"] = "tool_calls"
        body = self._collected(choices, "chat.completion")
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0]
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = await self.vllm_prompt_logprobs(0)
        return body
