"""A prefix cache over a :class:`~fv_core.kv.pool.PagedKVPool`: sequences that start with the same tokens
share those tokens' pages across requests (vLLM's automatic prefix caching, SGLang's radix cache).

The cache is a tree of pages per namespace. A namespace is everything besides the tokens that changes
the keys/values (the weights version, the adapters and their scales): sequences of different namespaces
never share a page. Below its root, each node is one page of the pool and the keys of the tokens written
in it, in order: a full page (``page_size`` keys) may have children, a partly filled one is a leaf. A key
is any hashable value naming one token's content at its place (a text token's id; an image token: the
image's content hash and the token's index); the path from the root fixes everything before it.

- ``insert`` records a sequence's pages under its tokens' keys (one reference per page it adds);
- ``lookup`` forks the longest cached prefix of a token sequence: full pages shared as they are, and a
  page matched only up to its first differing token shared too, so the caller's first write into it
  copies it (the pool's copy-on-write) and never changes what others read; ``match`` only measures it;
- pages only the cache references are kept until the pool needs them: the pool's ``reclaim`` evicts the
  least recently used leaf nobody else references, one page at a time.

The cache never decides what a token's keys are: the caller passes keys that determine its keys/values.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from fv_core.kv.pool import KVSeq, PagedKVPool


@dataclass(eq=False, slots=True)
class _Node:
    page: int  # the pool page (-1: a namespace's root)
    keys: tuple  # the keys of the tokens in the page, in order (full: page_size of them)
    parent: _Node | None
    children: dict[tuple, _Node] = field(default_factory=dict)  # by their keys
    used: int = 0  # last lookup or insert that passed through it (LRU)


@dataclass(slots=True)
class PrefixStats:
    """Counts since the cache was made."""

    lookups: int = 0  # lookup calls
    hits: int = 0  # lookups that matched at least one token
    looked_up_tokens: int = 0  # tokens asked for
    matched_tokens: int = 0  # tokens served from the cache (no prefill needed)
    evicted_pages: int = 0  # pages given back to the pool under its budget


class PrefixCache:
    """Pages of ``pool`` kept for later sequences that start with the same tokens.

    Attaching it makes the pool evict its least recently used unreferenced leaves when it runs out.
    """

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.stats = PrefixStats()
        self._roots: dict[Hashable, _Node] = {}
        self._clock = itertools.count(1)
        pool.reclaim = self._evict_one

    @property
    def cached_pages(self) -> int:
        """How many pages the cache holds a reference on."""
        return len(self.pages())

    def pages(self) -> set[int]:
        """The pages the cache holds a reference on."""
        with self.pool.lock:
            return {node.page for node in self._nodes()}

    def lookup(self, namespace: Hashable, keys: Sequence[Hashable]) -> KVSeq:
        """A new sequence over the cached pages of the longest prefix of ``keys`` (the caller owns it:
        ``pool.release`` it); its ``length`` is how many tokens matched (0: none)."""
        size = self.pool.page_size
        with self.pool.lock:
            self.stats.lookups += 1
            self.stats.looked_up_tokens += len(keys)
            node, pages, matched, now = self._roots.get(namespace), [], 0, next(self._clock)
            while node is not None:
                node.used = now
                chunk = tuple(keys[matched : matched + size])
                if len(chunk) == size and chunk in node.children:
                    node = node.children[chunk]
                    pages.append(node.page)
                    matched += size
                    continue
                best, common = None, 0
                for child in node.children.values():
                    n = common_prefix_length(child.keys, chunk)
                    if n > common:
                        best, common = child, n
                if best is not None:  # shared up to its first differing token (copied on the first write)
                    best.used = now
                    pages.append(best.page)
                    matched += common
                break
            self.pool.hold(pages)
            self.stats.hits += matched > 0
            self.stats.matched_tokens += matched
            return KVSeq(pages, matched)

    def match(self, namespace: Hashable, keys: Sequence[Hashable]) -> int:
        """How many leading tokens of ``keys`` a :meth:`lookup` would serve now (takes nothing, counts
        nothing)."""
        size = self.pool.page_size
        with self.pool.lock:
            node, matched = self._roots.get(namespace), 0
            while node is not None:
                chunk = tuple(keys[matched : matched + size])
                if len(chunk) == size and chunk in node.children:
                    node, matched = node.children[chunk], matched + size
                    continue
                return matched + max(
                    (common_prefix_length(c.keys, chunk) for c in node.children.values()), default=0
                )
            return matched

    def insert(self, namespace: Hashable, keys: Sequence[Hashable], seq: KVSeq) -> None:
        """Record ``seq``'s pages under ``keys`` (one per token of ``seq``). Pages of prefixes already cached
        stay as they are (a sequence that wrote its own copy of a cached prefix adds nothing past it); a
        partly filled page that a longer one now covers is dropped."""
        if len(keys) != seq.length:
            raise ValueError(f"insert of {seq.length} tokens with {len(keys)} keys: give one key per token")
        size = self.pool.page_size
        with self.pool.lock:
            now = next(self._clock)
            node = self._roots.setdefault(namespace, _Node(-1, (), None))
            node.used = now
            for index, page in enumerate(seq.pages):
                chunk = tuple(keys[index * size : (index + 1) * size])
                child = node.children.get(chunk)
                if child is not None and child.page != page:
                    # another sequence's copy of this prefix: keep it, and hang nothing of this sequence
                    # under it (a page held by a sequence always has its ancestors held by it too, so
                    # whatever only the cache holds can be evicted, leaves first)
                    child.used = now
                    return
                if child is None:
                    for other in [c for c in node.children.values() if _covers(chunk, c.keys)]:
                        self._remove(other)  # a partial page this one extends: never the better match
                    if any(_covers(c.keys, chunk) for c in node.children.values()):
                        return  # a page already holds these tokens and more
                    child = node.children[chunk] = _Node(page, chunk, node)
                    self.pool.hold([page])
                child.used = now
                if len(chunk) < size:
                    return
                node = child

    def clear(self) -> int:
        """Evict every page nobody else references; returns how many."""
        with self.pool.lock:
            n = 0
            while self._evict_one():
                n += 1
            return n

    def _nodes(self):  # every page node, parents first
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict_one(self) -> bool:
        """Give the pool the page of the least recently used leaf only the cache references."""
        leaves = [n for n in self._nodes() if not n.children and self.pool.refs[n.page] == 1]
        if not leaves:
            return False
        leaf = min(leaves, key=lambda n: n.used)
        self._remove(leaf)
        self.stats.evicted_pages += 1
        if (
            leaf.parent is not None and leaf.parent.page == -1 and not leaf.parent.children
        ):  # an empty namespace
            self._roots = {k: r for k, r in self._roots.items() if r is not leaf.parent}
        return True

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None and not node.children, "only leaves are removed"
        del node.parent.children[node.keys]
        self.pool.drop([node.page])


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _covers(longer: tuple, shorter: tuple) -> bool:
    """``longer`` holds ``shorter`` and more after it."""
    return len(longer) > len(shorter) and longer[: len(shorter)] == shorter
