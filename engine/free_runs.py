"""Free blocks that cache nothing, kept as runs of consecutive block ids.

Which of these blocks a request gets changes nothing for the prefix cache,
so the pool hands them out by address: a request whose blocks are
consecutive is a few long memory ranges per layer in the paged cache, which
a KV transport moves as a few large segments instead of one per block.

Runs are maximal (two runs never touch) and filed by size class, class
``k`` holding runs of ``2**k`` to ``2**(k+1) - 1`` blocks, so that taking
and returning blocks costs O(1) dict operations plus a walk over the few
classes::

    free ids   2 3 4 . . 7 . 9 10 11 12 13
    runs       (2, 3)    (7, 1) (9, 5)      start, length
    classes    0: {7}   1: {2}   2: {9}
"""

from __future__ import annotations


class FreeRuns:
    def __init__(self, num_blocks: int = 0) -> None:
        """All of ``0 .. num_blocks - 1`` free (``add`` more at will)."""
        self._length: dict[int, int] = {}  # run start -> length
        self._start: dict[int, int] = {}  # run end (exclusive) -> start
        # Size class -> starts of its runs (a dict as an insertion-ordered set).
        self._classes: list[dict[int, None]] = [{} for _ in range(num_blocks.bit_length() + 1)]
        self._count = num_blocks
        if num_blocks:
            self._insert(0, num_blocks)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block_id: int) -> bool:
        return self._run_of(block_id) is not None

    def block_ids(self) -> list[int]:
        """Every free id, ascending (for tests and debugging)."""
        return [i for s in sorted(self._length) for i in range(s, s + self._length[s])]

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run, by start (for tests and debugging)."""
        return sorted(self._length.items())

    def add(self, block_id: int) -> None:
        """Return one block, merging it with the runs on either side."""
        start, length = block_id, 1
        left = self._start.get(block_id)
        if left is not None:
            start, length = left, self._remove(left) + 1
        if block_id + 1 in self._length:
            length += self._remove(block_id + 1)
        self._insert(start, length)
        self._count += 1

    def take(self, n: int, after: int | None = None) -> list[int]:
        """``n`` free ids (at most ``len(self)``), in as few runs as the
        free space allows: the ones right after ``after`` first when they
        are free (a request growing its table), then a run that holds the
        rest, from the smallest size class that has one (leaving long runs
        for long requests), or, when none does, the longest runs there are."""
        if n > self._count:
            raise ValueError(f"asked for {n} blocks, {self._count} free")
        out: list[int] = []
        if after is not None and after + 1 in self._length:
            out.extend(self._carve(after + 1, n))
        while len(out) < n:
            want = n - len(out)
            start = self._fitting(want)
            if start is None:
                start = self._longest()
            out.extend(self._carve(start, want))
        self._count -= n
        return out

    def discard(self, block_id: int) -> None:
        """Take one given block out (O(length of its run))."""
        start = self._run_of(block_id)
        if start is None:
            raise KeyError(f"block {block_id} is not in a free run")
        length = self._remove(start)
        if block_id > start:
            self._insert(start, block_id - start)
        if start + length > block_id + 1:
            self._insert(block_id + 1, start + length - block_id - 1)
        self._count -= 1

    # ---- internals -------------------------------------------------------------

    def _fitting(self, n: int) -> int | None:
        """Start of a run of at least ``n``: from the smallest class whose
        runs all fit, else a fitting run of the class just below."""
        for k in range((n - 1).bit_length(), len(self._classes)):
            if self._classes[k]:
                return next(iter(self._classes[k]))
        below = n.bit_length() - 1
        if below < len(self._classes):
            return next((s for s in self._classes[below] if self._length[s] >= n), None)
        return None

    def _longest(self) -> int:
        """Start of a run of the highest non-empty class."""
        for k in range(len(self._classes) - 1, -1, -1):
            if self._classes[k]:
                return max(self._classes[k], key=self._length.__getitem__)
        raise IndexError("no free runs")

    def _carve(self, start: int, n: int) -> list[int]:
        """Up to ``n`` ids from the front of the run at ``start``."""
        length = self._remove(start)
        used = min(n, length)
        if length > used:
            self._insert(start + used, length - used)
        return list(range(start, start + used))

    def _run_of(self, block_id: int) -> int | None:
        # NOTE: a walk down to the run's start; only discard() and membership
        # tests need it, and they are rare next to add/take.
        for start in range(block_id, -1, -1):
            length = self._length.get(start)
            if length is not None:
                return start if block_id < start + length else None
            if start in self._start:
                return None  # a run ends just below `start`, which is not free: nor is block_id
        return None

    def _insert(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start[start + length] = start
        k = length.bit_length() - 1
        while k >= len(self._classes):
            self._classes.append({})
        self._classes[k][start] = None

    def _remove(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start[start + length]
        del self._classes[length.bit_length() - 1][start]
        return length
