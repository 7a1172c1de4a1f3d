"""The radix (trie) index of cached token prefixes, on rank 0's scheduler.

Entries are KV-cache sequences (keys of `PagedKVCache.seqs`) with the tokens they hold: the
sequences of running requests (their prompt, once prefilled) and of finished ones kept as
cache (prompt + answer). Each entry's sequence names pages on every CP rank, so the index
itself is rank-free: a match says "the first n tokens of this prompt are the first n tokens
of sequence `key`", and `PagedKVCache.fork` turns that into shared pages on every rank.

The trie is keyed by token pages (tuples of `page` tokens): a node is one full page of
tokens and knows the entries whose tokens pass through it; an entry whose length is not a
multiple of `page` keeps its last partial page as a tail of its deepest node. A match walks
whole pages, then takes the longest common prefix with the next page of any child or tail,
so it is exact to the token.

Finished entries are evictable in least-recently-used order (`lru`); a match touches its
entry. Running requests' entries are never evicted here (the scheduler removes them when a
request is preempted).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Node:
    keys: set[int] = field(default_factory=set)  # entries whose tokens cover this page
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    tails: dict[int, tuple[int, ...]] = field(default_factory=dict)  # entry -> partial page


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixIndex:
    def __init__(self, page: int) -> None:
        self.page = page
        self.root = _Node()
        self.lengths: dict[int, int] = {}  # entry -> tokens indexed
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable entries, oldest first

    def __contains__(self, key: int) -> bool:
        return key in self.lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def insert(self, key: int, tokens: list[int], evictable: bool = False) -> None:
        """Index `tokens` as held by sequence `key` (replacing what it held before)."""
        self.remove(key)
        node, ps = self.root, self.page
        full = len(tokens) // ps
        for i in range(full):
            chunk = tuple(tokens[i * ps:(i + 1) * ps])
            node = node.children.setdefault(chunk, _Node())
            node.keys.add(key)
        if len(tokens) % ps:
            node.tails[key] = tuple(tokens[full * ps:])
        self.lengths[key] = len(tokens)
        if evictable:
            self.lru[key] = None

    def remove(self, key: int) -> None:
        length = self.lengths.pop(key, None)
        self.lru.pop(key, None)
        if length is None:
            return
        # a loop, not recursion: a 64K-token prompt is 4,096 pages deep
        path, node = [], self.root
        for _ in range(length // self.page):
            chunk, child = next((c, ch) for c, ch in node.children.items() if key in ch.keys)
            child.keys.discard(key)
            path.append((node, chunk, child))
            node = child
        node.tails.pop(key, None)
        for parent, chunk, child in reversed(path):  # drop the nodes no entry passes
            if child.keys or child.tails:
                break  # its ancestors hold at least its entries
            del parent.children[chunk]

    def match(self, tokens: list[int]) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with `tokens` -> (key, shared tokens);
        (None, 0) if none shares one. Touches the entry (LRU)."""
        node, ps, depth = self.root, self.page, 0
        while len(tokens) >= (depth + 1) * ps:
            child = node.children.get(tuple(tokens[depth * ps:(depth + 1) * ps]))
            if child is None:
                break
            node, depth = child, depth + 1
        rest = tokens[depth * ps:(depth + 1) * ps]
        best_key, best = (next(iter(node.keys)) if node.keys else None), 0
        if rest:
            for chunk, child in node.children.items():
                n = _common(chunk, rest)
                if n > best:
                    best_key, best = next(iter(child.keys)), n
            for key, tail in node.tails.items():
                n = _common(tail, rest)
                if n > best:
                    best_key, best = key, n
        if best_key is None:
            return None, 0
        if best_key in self.lru:
            self.lru.move_to_end(best_key)
        return best_key, depth * ps + best

    def evictable(self) -> list[int]:
        """Finished entries, least recently used first."""
        return list(self.lru)
