"""Turns per-sequence progress into RequestOutputs: groups the ``n``
completions of a request, detokenizes incrementally and finds stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.tokenizer import Tokenizer


@dataclass
class _Completion:
    request: Request
    detok: IncrementalDetokenizer | None
    num_tokens_sent: int = 0
    # The logprobs of the first ``num_summed`` output tokens, summed as they come.
    cumulative_logprob: float = 0.0
    num_summed: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        # sequence id -> (group, completion index)
        self.by_seq: dict[str, tuple[RequestGroup, int]] = {}

    def add(self, request_id: str, prompt: str | None, sequences: list[Request]) -> None:
        group = RequestGroup(request_id, prompt, sequences[0].prompt_token_ids)
        for seq in sequences:
            p = seq.params
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, seq.prompt_token_ids, p.stop,
                    p.include_stop_str_in_output, p.skip_special_tokens, p.min_tokens,
                )
            group.completions.append(_Completion(seq, detok))
            self.by_seq[seq.request_id] = (group, seq.index)
        self.groups[request_id] = group

    def process(self, changed: list[Request]) -> tuple[list[RequestOutput], list[str]]:
        """Outputs for the groups touched by ``changed`` sequences, and the ids
        of sequences that a stop string has just finished."""
        touched: dict[str, RequestGroup] = {}
        stopped: list[str] = []
        for seq in changed:
            entry = self.by_seq.get(seq.request_id)
            if entry is None:
                continue
            group, index = entry
            comp = group.completions[index]
            if comp.finish_reason is not None:
                continue
            if comp.detok is not None:
                new = seq.token_ids[seq.num_prompt_tokens + comp.detok.num_tokens :]
                if new and _ends_on_stop_token(seq):
                    # The EOS or stop token that ended the sequence: kept in
                    # the token ids, not in the text (as vLLM does).
                    new = new[:-1]
                for token in new:
                    comp.detok.add(token)
                    if comp.detok.stop_reason is not None:
                        break
                if comp.detok.stop_reason is not None:
                    # NOTE: also when this token ended the request for another
                    # reason (max_tokens): the text is cut at the stop string.
                    comp.finish_reason, comp.stop_reason = "stop", comp.detok.stop_reason
                    if not seq.finished:
                        stopped.append(seq.request_id)
            if seq.finished and comp.finish_reason is None:
                comp.finish_reason, comp.stop_reason = seq.finish_reason, seq.stop_reason
            touched[group.request_id] = group
        outputs = [self._output(g) for g in touched.values()]
        for group in touched.values():
            if group.finished:
                self._drop(group)
        return outputs, stopped

    def skip_sent(self, request_id: str, num_tokens: int) -> None:
        """The first ``num_tokens`` output tokens were sent by an earlier
        attempt (a migrated request): output only what follows them.

        NOTE: the detokenizer replays them rather than restarting after them:
        the earlier attempt may have held back text (half of a multi-byte
        character, a possible stop-string prefix) that the client has not
        seen; replayed, it is held back here too and sent once complete."""
        for comp in self.groups[request_id].completions:
            comp.num_tokens_sent = num_tokens
            if comp.detok is not None:
                start = comp.request.num_prompt_tokens
                for token in comp.request.token_ids[start : start + num_tokens]:
                    comp.detok.add(token)
                comp.detok.take(final=False)  # what the earlier attempt sent

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for comp in group.completions:
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
        out = self._output(group)
        self._drop(group)
        return out

    def sequences(self, request_id: str) -> list[Request]:
        group = self.groups.get(request_id)
        return [c.request for c in group.completions] if group else []

    def _output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for comp in group.completions:
            seq = comp.request
            finished = comp.finish_reason is not None
            token_ids = seq.output_token_ids
            if comp.detok is not None and comp.detok.stop_reason is not None:
                # Tokens after the one that completed a stop string are not output.
                token_ids = token_ids[: comp.detok.num_tokens]
            delta_ids = token_ids[comp.num_tokens_sent :]
            comp.num_tokens_sent = len(token_ids)
            delta_text = comp.detok.take(final=finished) if comp.detok else ""
            text = comp.detok.text if comp.detok else ""
            if comp.detok is not None and not finished:
                text = text[: comp.detok.num_emitted]
            logprobs = cumulative = None
            if seq.params.logprobs is not None:
                logprobs = list(seq.logprobs[: len(token_ids)])
                for t, entry in zip(token_ids[comp.num_summed:], logprobs[comp.num_summed:]):
                    comp.cumulative_logprob += entry.get(t, 0.0)
                comp.num_summed = len(logprobs)
                cumulative = comp.cumulative_logprob
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids,  # a fresh slice already
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                logprobs=logprobs, delta_text=delta_text, delta_token_ids=delta_ids,
                cumulative_logprob=cumulative,
            ))
        first = group.completions[0].request
        metrics = {"arrival_time": group.arrival_time}
        if first.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = first.first_scheduled_time
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=outs, finished=group.finished,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None
            else None,
            num_cached_tokens=first.num_cached_tokens, metrics=metrics,
        )

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for comp in group.completions:
            self.by_seq.pop(comp.request.request_id, None)


def _ends_on_stop_token(seq: Request) -> bool:
    """``seq`` finished on an EOS or stop token whose text is not output."""
    return (seq.status == RequestStatus.FINISHED_STOPPED
            and not seq.params.include_stop_str_in_output)
