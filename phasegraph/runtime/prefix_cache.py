"""A radix tree over KV pages shared between requests (prefix caching).

Each node holds a run of whole pages and the tokens whose KV they hold (``len(key) ==
len(pages) * P``); a path from the root spells a token prefix whose target and draft KV sit in
the path's pages. The tree owns its pages. A request that reuses a prefix *borrows* the path's
pages (they head its page-table row) and locks the path's deepest node: locked nodes and their
ancestors are never evicted; unlocked ones are evicted least recently used first, leaves first,
when the pool runs short (SGLang's RadixAttention, arXiv 2312.07104, §3).

The draft's KV lead (docs/internals.md, "The draft's KV lead"): with lead 0 draft row p carries
token p+1, so a page's last draft row was computed with the token *after* the page. Within a
node that token is the node's own next key token; for a node's last page it is ``next_token``
(the token the inserting sequence had there, None when unknown). A page is reused only where
that token is the request's own, so the draft rows a request reuses are exactly the ones its own
prefill would have written. Lead 1 (standalone) and no draft need no such check.

Host-side bookkeeping only: no tensor is touched here.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import attrs


class Node:
    """A run of pages of the tree (see the module doc)."""

    __slots__ = ("key", "pages", "children", "parent", "lock", "last_used", "next_token")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, next_token: int | None):
        self.key = key  # tokens, len(pages) * page_size of them
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}  # by the tokens of the child's first page
        self.parent = parent
        self.lock = 0  # requests whose borrowed prefix runs through this node
        self.last_used = 0
        self.next_token = next_token  # lead 0: the token the last page's last draft row was computed with


@attrs.frozen
class PrefixMatch:
    """The longest reusable cached prefix of a token sequence."""

    length: int  # tokens served from the cache, a multiple of the page size
    pages: tuple[int, ...]  # the pages that hold them, in order
    node: Node  # the deepest node of the match (the root when nothing matched)
    unlocked_pages: int  # pages of the match that are evictable now (locking takes them out)


class RadixCache:
    """The tree, its page accounting and LRU eviction.

    ``check_next_token``: the draft's KV lead is 0 (reuse a page only where the token after it
    is the request's own)."""

    def __init__(self, page_size: int, *, check_next_token: bool) -> None:
        self.page_size = page_size
        self.check_next_token = check_next_token
        self.root = Node((), [], None, None)
        self.root.lock = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree owns
        self.evictable_pages = 0  # of them, in unlocked nodes

    # -- lookups ------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The longest prefix of ``tokens`` of at most ``limit`` tokens whose pages can be
        reused. A node the match ends inside is split there, so that a lock covers exactly
        the matched pages."""
        P = self.page_size
        node, length, pages, unlocked = self.root, 0, [], 0
        while length + P <= limit:
            child = node.children.get(tuple(tokens[length : length + P]))
            if child is None:
                break
            usable = 0
            for j in range(len(child.pages)):
                start = length + j * P
                if start + P > limit or tuple(child.key[j * P : (j + 1) * P]) != tuple(tokens[start : start + P]):
                    break
                if self.check_next_token and not self._next_ok(child, j, tokens, start + P):
                    break
                usable = j + 1
            if usable == 0:
                break
            partial = usable < len(child.pages)
            if partial:
                child = self._split(child, usable)
            child.last_used = next(self._clock)
            pages += child.pages
            unlocked += len(child.pages) if child.lock == 0 else 0
            length += usable * P
            node = child
            if partial:
                break
        return PrefixMatch(length, tuple(pages), node, unlocked)

    def _next_ok(self, node: Node, j: int, tokens: Sequence[int], at: int) -> bool:
        """Page ``j`` of ``node``'s last draft row was computed with ``tokens[at]``."""
        end = (j + 1) * self.page_size
        nxt = node.key[end] if end < len(node.key) else node.next_token
        return at < len(tokens) and nxt == tokens[at]

    # -- locks --------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A request borrows the path from the root to ``node``."""
        while node is not None and node is not self.root:
            if node.lock == 0:
                self.evictable_pages -= len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    # -- insertion and eviction ---------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int], next_token: int | None) -> tuple[Node, set[int]]:
        """Add the prefix ``tokens`` (``len(pages) * P`` of them) held by ``pages``; the tree
        takes the pages of the positions it did not hold yet. Returns the deepest node of the
        path and the pages taken (the caller frees its other pages, except those it borrowed
        from the tree: those are the tree's own pages of their positions). ``next_token``: the
        token after ``tokens`` in the inserting sequence (lead 0: its last draft row's)."""
        P = self.page_size
        if len(tokens) != len(pages) * P:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {P}")
        node, at, taken = self.root, 0, set()
        stamp = next(self._clock)
        while at < len(tokens):
            first = tuple(tokens[at : at + P])
            child = node.children.get(first)
            if child is None:
                new = Node(tuple(tokens[at:]), list(pages[at // P :]), node, next_token)
                new.last_used = stamp
                node.children[first] = new
                self.num_pages += len(new.pages)
                self.evictable_pages += len(new.pages)
                taken.update(new.pages)
                return new, taken
            same = 1
            while (same < len(child.pages) and at + (same + 1) * P <= len(tokens)
                   and child.key[same * P : (same + 1) * P] == tuple(tokens[at + same * P : at + (same + 1) * P])):
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
        upper = Node(node.key[:cut], node.pages[:pages], node.parent, node.key[cut])
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
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def clear(self) -> list[int]:
        """Evict every unlocked node; returns their pages."""
        return self.evict(self.evictable_pages)

    # -- accounting ---------------------------------------------------------------------------

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
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
        while node is not None and node is not self.root:
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
            while node is not self.root:
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
