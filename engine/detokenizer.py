"""Incremental detokenization with stop strings. Torch-free.

Text is decoded over a sliding window of token ids: a delta is emitted only
when the window's text grows and does not end in U+FFFD, so half of a
multi-byte character is never sent. Up to ``len(longest stop) - 1``
characters are held back, so a stop string split across tokens is never
partly streamed.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        """Stop strings are looked for once more than ``min_tokens`` tokens
        are in (as in vLLM): text of the first ``min_tokens`` never stops."""
        self.tokenizer = tokenizer
        # A few prompt tokens give the first output token its context (a
        # leading space, a continued word).
        self.ids = list(prompt_token_ids[-6:])
        self.prefix_offset = max(0, len(self.ids) - 5)
        self.read_offset = len(self.ids)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop-truncated)
        self.num_emitted = 0  # characters of ``text`` already handed out
        self.stop_reason: str | None = None
        self.min_tokens = min_tokens
        self.num_tokens = 0  # tokens added (before a stop string matched)

    def restart(self, token_ids: list[int]) -> None:
        """Continue after ``token_ids`` whose text was handed out elsewhere."""
        self.ids = list(token_ids[-6:])
        self.prefix_offset = max(0, len(self.ids) - 5)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_reason`` if a stop string matched."""
        if self.stop_reason is not None:
            return
        self.num_tokens += 1
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._append(full[len(prefix) :])

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        if self.num_tokens <= self.min_tokens:
            return
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[: at + len(s) if self.include_stop else at]
                self.stop_reason = s
                return

    def take(self, final: bool) -> str:
        """The text not yet handed out; holds back a possible stop-string
        prefix unless ``final``."""
        if final:
            self._flush()
        end = len(self.text) if final or self.stop_reason else len(self.text) - self.holdback
        if end <= self.num_emitted:
            return ""
        out = self.text[self.num_emitted : end]
        self.num_emitted = end
        return out

    def _flush(self) -> None:
        # NOTE: at the end, bytes held back for an incomplete character will
        # never be completed: decode them as U+FFFD so that the text equals a
        # full decode of the tokens.
        if self.stop_reason is not None or self.read_offset == len(self.ids):
            return
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if len(full) > len(prefix):
            self._append(full[len(prefix) :])
