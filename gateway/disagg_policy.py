"""Where to prefill, per request: on a prefill worker (then move the KV) or
on the chosen decode worker itself (``--disagg-policy``).

``always``: remote, as before this policy existed (no prefill worker in
rotation fails the attempt); ``never``: the decode worker computes every
prompt itself; ``auto``: a cost model, in seconds, from

- the prompt tokens each side would compute: the prompt less the prefix
  each side likely has cached (``PrefixTracker``: the block-chained prefixes
  this gateway sent to each worker lately; an estimate, never a promise),
- the seconds per computed prompt token, measured from finished remote
  prefills (the Prefill call's time less its transfer, per uncached token),
- each side's queue (running + waiting + this gateway's calls in flight),
- the KV bytes of the prompt over the measured bandwidth of the pair (from
  the prefill replies' bytes and transfer seconds), plus a fixed call overhead.

    local  = uncached_on_decode  * s_per_token * (1 + decode queue)
    remote = uncached_on_prefill * s_per_token * (1 + prefill queue)
             + kv_bytes / pair_bandwidth + REMOTE_OVERHEAD_S

The decode queue counts twice over, in effect: a prompt computed there waits
behind its streams and stalls each of them for as long. Prompts with at most
``min_remote_tokens`` uncached tokens on the decode worker always stay local
(short prompts, long cached prefixes): a handoff costs more than it saves.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("always", "never", "auto")
DEFAULT_S_PER_TOKEN = 1e-3  # until a remote prefill has been measured
DEFAULT_BANDWIDTH = 200 * 2**20  # bytes/s, until the pair has moved KV
REMOTE_OVERHEAD_S = 0.005  # the extra calls of a handoff (reserve, prefill, decode)
PREFIXES_PER_WORKER = 4096
EWMA = 0.2


@dataclass(frozen=True)
class Decision:
    remote: bool
    reason: str
    inputs: dict


class PrefixTracker:
    """Per worker, the chained hashes of full prompt blocks recently sent there."""

    def __init__(self, capacity: int = PREFIXES_PER_WORKER) -> None:
        self.capacity = capacity
        self.seen: dict[str, OrderedDict[bytes, None]] = {}

    @staticmethod
    def _chain(prompt: list[int], block_size: int):
        h = b""
        for i in range(0, len(prompt) - block_size + 1, block_size):
            h = hashlib.sha256(h + ",".join(map(str, prompt[i:i + block_size])).encode()).digest()
            yield i + block_size, h

    def record(self, address: str, prompt: list[int], block_size: int) -> None:
        seen = self.seen.setdefault(address, OrderedDict())
        for _, h in self._chain(prompt, block_size):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def hit_tokens(self, address: str, prompt: list[int], block_size: int) -> int:
        seen = self.seen.get(address, {})
        hit = 0
        for end, h in self._chain(prompt, block_size):
            if h not in seen:
                break
            hit = end
        return min(hit, len(prompt) - 1)  # the last token is always computed


class DisaggPolicy:
    def __init__(self, policy: str = "always", min_remote_tokens: int = 256) -> None:
        if policy not in POLICIES:
            raise ValueError(f"disagg policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.min_remote_tokens = min_remote_tokens
        self.prefixes = PrefixTracker()
        self.s_per_token = DEFAULT_S_PER_TOKEN
        self.bandwidth: dict[tuple[str, str], float] = {}

    def decide(self, prompt: list[int], decode, prefill, kv_bytes_per_token: int) -> Decision:
        """``decode``/``prefill``: WorkerViews (``prefill`` None: none in rotation)."""
        if self.policy == "always":  # with no prefill worker the attempt fails, as it did
            return Decision(True, "policy always", {})
        if self.policy == "never":
            return Decision(False, "policy never", {})
        if prefill is None:
            return Decision(False, "no prefill worker", {})
        n = len(prompt)
        local_new = n - self.prefixes.hit_tokens(decode.address, prompt, decode.block_size)
        remote_new = n - self.prefixes.hit_tokens(prefill.address, prompt, prefill.block_size)
        bw = self.bandwidth.get((prefill.address, decode.address), DEFAULT_BANDWIDTH)
        local = local_new * self.s_per_token * (1 + decode.load)
        remote = (remote_new * self.s_per_token * (1 + prefill.load)
                  + n * kv_bytes_per_token / bw + REMOTE_OVERHEAD_S)
        inputs = {"prompt_tokens": n, "uncached_local": local_new, "uncached_remote": remote_new,
                  "decode_queue": decode.load, "prefill_queue": prefill.load,
                  "s_per_token": self.s_per_token, "pair_bandwidth": bw,
                  "cost_local_s": local, "cost_remote_s": remote}
        if local_new <= self.min_remote_tokens:
            return Decision(False, "short or cached on the decode worker", inputs)
        if remote < local:
            return Decision(True, "remote is cheaper", inputs)
        return Decision(False, "local is cheaper", inputs)

    def routed(self, address: str, prompt: list[int], block_size: int) -> None:
        """``prompt`` was computed on ``address``: its prefix is likely cached there."""
        self.prefixes.record(address, prompt, block_size)

    def observe_prefill(self, prefill: str, decode: str, uncached_tokens: int,
                        call_seconds: float, kv_bytes: int, transfer_seconds: float) -> None:
        if kv_bytes and transfer_seconds > 0:
            rate = kv_bytes / transfer_seconds
            old = self.bandwidth.get((prefill, decode))
            self.bandwidth[(prefill, decode)] = rate if old is None else \
                (1 - EWMA) * old + EWMA * rate
        compute = call_seconds - transfer_seconds
        if uncached_tokens > 0 and compute > 0:
            self.s_per_token = (1 - EWMA) * self.s_per_token + EWMA * compute / uncached_tokens
