"""A radix tree over KV pages shared between requests (prefix caching).

Each node holds a run of whole pages and the tokens whose KV they hold (``len(key) ==
len(pages) * P``); a path from the root spells a token prefix whose target and draft KV sit in
the path's pages. The tree owns its pages. A request that reuses a prefix *borrows* the path's
pages (they head its page-table row) and locks the path's deepest node: locked nodes and their
ancestors are never evicted; unlocked ones are evicted least recently used first, leaves first,
when the pool runs short (SGLang's RadixAttention, arXiv 2312.07104, §3).

The draft's KV lead (docs/internals.md, "The draft's KV lead"): with lead 0 draft row p carries
token p+1, so page j's KV depends on the tokens up to position ``(j+1)*P`` included, one past
the page. The tree then keys page j by the tokens ``j*P+1 .. (j+1)*P`` (the sequence shifted by
one) under a root per first token: two sequences that part right after a page keep one copy of
that page each, each with the draft rows its own continuation needs, and a request reuses
exactly the KV its own prefill would have written. Lead 1 (standalone) and no draft key pages by
their own tokens.

Host-side bookkeeping only: no tensor is touched here.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import attrs


class Node:
    """A run of pages of the tree (see the module doc)."""

    __slots__ = ("key", "pages", "children", "parent", "lock", "last_used")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None):
        self.key = key  # len(pages) * page_size tokens: the pages' own, or shifted by one (lead 0)
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}  # by the key of the child's first page
        self.parent = parent  # None for a root
        self.lock = 0  # requests whose borrowed prefix runs through this node
        self.last_used = 0


@attrs.frozen
class PrefixMatch:
    """The longest reusable cached prefix of a token sequence."""

    length: int  # tokens served from the cache, a multiple of the page size
    pages: tuple[int, ...]  # the pages that hold them, in order
    node: Node  # the deepest node of the match (a root when nothing matched)
    unlocked_pages: int  # pages of the match that are evictable now (locking takes them out)


class RadixCache:
    """The tree, its page accounting and LRU eviction.

    ``shift``: 1 where the draft's KV lead is 0 (a page's KV depends on the token after it), else
    0."""

    def __init__(self, page_size: int, *, shift: int) -> None:
        if shift not in (0, 1):
            raise ValueError(f"shift must be 0 or 1, got {shift}")
        self.page_size = page_size
        self.shift = shift
        self.roots: dict[int | None, Node] = {}  # by the first token (shift 1), else one, None
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree owns
        self.evictable_pages = 0  # of them, in unlocked nodes

    def _root(self, tokens: Sequence[int], create: bool) -> tuple[Node | None, tuple[int, ...]]:
        """The root ``tokens`` live under, and their key sequence (page j: key ``[j*P, (j+1)*P)``)."""
        first = tokens[0] if self.shift and len(tokens) else None
        root = self.roots.get(first)
        if root is None and create:
            root = self.roots[first] = Node((), [], None)
        return root, tuple(tokens[self.shift :])

    # -- lookups ------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` of at most ``limit`` tokens (``limit <
        len(tokens)``). A node the match ends inside is split there, so that a lock covers
        exactly the matched pages."""
        P = self.page_size
        root, key = self._root(tokens, create=False)
        if root is None:
            return PrefixMatch(0, (), Node((), [], None), 0)
        node, length, pages, unlocked = root, 0, [], 0
        limit = min(limit, len(key))
        while length + P <= limit:
            child = node.children.get(key[length : length + P])
            if child is None:
                break
            same = 1
            while (same < len(child.pages) and length + (same + 1) * P <= limit
                   and child.key[same * P : (same + 1) * P] == key[length + same * P : length + (same + 1) * P]):
                same += 1
            partial = same < len(child.pages)
            if partial:
                child = self._split(child, same)
            child.last_used = next(self._clock)
            pages += child.pages
            unlocked += len(child.pages) if child.lock == 0 else 0
            length += same * P
            node = child
            if partial:
                break
        return PrefixMatch(length, tuple(pages), node, unlocked)

    # -- locks --------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A request borrows the path from the root to ``node``."""
        while node.parent is not None:
            if node.lock == 0:
                self.evictable_pages -= len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    # -- insertion and eviction ---------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[Node, set[int]]:
        """Add the KV held by ``pages`` of the sequence ``tokens`` (``len(pages) * P`` tokens,
        and with ``shift`` 1 the token after them); the tree takes the pages of positions it
        did not hold yet. Returns the deepest node of the path and the pages taken (the caller
        frees its other pages, except those it borrowed from the tree: those are the tree's own
        pages of their positions)."""
        P = self.page_size
        if len(tokens) != len(pages) * P + self.shift:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {P} (+{self.shift})")
        root, key = self._root(tokens, create=True)
        node, at, taken = root, 0, set()
        stamp = next(self._clock)
        while at < len(key):
            child = node.children.get(key[at : at + P])
            if child is None:
                new = Node(key[at:], list(pages[at // P :]), node)
                new.last_used = stamp
                node.children[new.key[:P]] = new
                self.num_pages += len(new.pages)
                self.evictable_pages += len(new.pages)
                taken.update(new.pages)
                return new, taken
            same = 1
            while (same < len(child.pages) and at + (same + 1) * P <= len(key)
                   and child.key[same * P : (same + 1) * P] == key[at + same * P : at + (same + 1) * P]):
                same += 1
            if same < len(child.pages):
                child = self._split(child, same)
            child.last_used = stamp
            at += same * P
            node = child
        return node, taken

    def _split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after its first ``pages`` pages; returns the new upper part. The node
        object itself stays the lower part, so the locks requests hold on it stay valid."""
        P = self.page_size
        cut = pages * P
        upper = Node(node.key[:cut], node.pages[:pages], node.parent)
        upper.lock, upper.last_used = node.lock, node.last_used
        node.parent.children[node.key[:P]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[pages:], upper
        upper.children[node.key[:P]] = node
        return upper

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, least recently used first, until ``num_pages`` pages (or
        every evictable one) are out; returns the pages, for the caller to free."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(leaves)
            freed += leaf.pages
            self.num_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent.parent is not None and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.roots = {first: root for first, root in self.roots.items() if root.children}
        return freed

    def clear(self) -> list[int]:
        """Evict every unlocked node; returns their pages."""
        return self.evict(self.evictable_pages)

    # -- accounting ---------------------------------------------------------------------------

    def _nodes(self) -> list[Node]:
        out, stack = [], [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def pages(self) -> list[int]:
        """Every page the tree owns."""
        return [p for n in self._nodes() for p in n.pages]

    def path_pages(self, node: Node) -> list[int]:
        """The pages from the root down to ``node``, in order."""
        runs = []
        while node.parent is not None:
            runs.append(node.pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def check(self, locks: Sequence[Node]) -> list[str]:
        """Problems with the tree's bookkeeping, given the nodes requests hold locks on."""
        problems = []
        nodes = self._nodes()
        P = self.page_size
        want = {id(n): 0 for n in nodes}
        for node in locks:
            while node.parent is not None:
                if id(node) not in want:
                    problems.append("a request holds a lock on a node that is not in the tree")
                    break
                want[id(node)] += 1
                node = node.parent
        for n in nodes:
            if len(n.key) != len(n.pages) * P or not n.pages:
                problems.append(f"a node holds {len(n.key)} tokens in {len(n.pages)} pages of {P}")
            if n.lock != want[id(n)]:
                problems.append(f"a node has lock {n.lock}, {want[id(n)]} requests borrow it")
        if sum(len(n.pages) for n in nodes) != self.num_pages:
            problems.append(f"the tree counts {self.num_pages} pages, its nodes hold {sum(len(n.pages) for n in nodes)}")
        evictable = sum(len(n.pages) for n in nodes if n.lock == 0)
        if evictable != self.evictable_pages:
            problems.append(f"the tree counts {self.evictable_pages} evictable pages, {evictable} are unlocked")
        return problems
