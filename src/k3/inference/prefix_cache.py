"""Prefix caching, K3 style (docs/architecture.md, "Serving").

A transformer reuses a shared prefix by keeping its keys and values; K3 keeps, for each prefix that ends on a prefill
chunk boundary, the whole cache state after it: the KDA layers' recurrent states and conv windows (a fixed size,
whatever the prefix length) and the MLA latents of the prefix's positions. A request whose prompt starts with a
stored prefix copies that state and prefills only the rest, chunk by chunk on the same boundaries, so its caches and
logits are bit-identical to a prefill from position 0.

The snapshots' MLA latents are views of the prefilling request's own cache (positions below a cache's length are
never written again, and growing a cache copies it to new storage), so taking one costs only its KDA states.
Entries are evicted least recently used first when their bytes exceed the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from k3.model.cache import K3Cache


class PrefixCache:
    """Snapshots of single-sequence caches keyed by their token ids, bounded by `budget_bytes` (0: disabled)."""

    def __init__(self, budget_bytes: int, chunk: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes, self.chunk = budget_bytes, chunk
        self._entries: OrderedDict[tuple[int, ...], tuple[K3Cache, int]] = OrderedDict()
        self.nbytes = 0
        self.lookups = self.hits = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, ids: Sequence[int], cache: K3Cache) -> None:
        """Remember the state `cache` holds after `ids` (a chunk boundary; `cache.length == len(ids)`)."""
        if self.budget_bytes == 0 or cache.length != len(ids):
            return
        key = tuple(ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        snapshot = cache.snapshot()
        size = snapshot.nbytes()
        if size > self.budget_bytes:
            return
        self._entries[key] = (snapshot, size)
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted

    def longest(self, ids: Sequence[int]) -> K3Cache | None:
        """A fresh, writable copy of the state after the longest stored prefix of `ids` that leaves at least one
        token of `ids` to prefill (its logits are the next token's), or None."""
        if self.budget_bytes == 0:
            return None
        self.lookups += 1
        for end in range((len(ids) - 1) // self.chunk * self.chunk, 0, -self.chunk):
            entry = self._entries.get(tuple(ids[:end]))
            if entry is not None:
                self._entries.move_to_end(tuple(ids[:end]))
                self.hits += 1
                self.tokens_reused += end
                return entry[0].clone()
        return None
