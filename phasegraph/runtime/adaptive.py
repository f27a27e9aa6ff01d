"""Adaptive speculation: the shape of the next iteration, from measured costs and acceptance.

A speculative engine runs each iteration in one of a few shapes (:class:`SpecShape`): ``off``
(the target alone, one token per request), a chain of S drafts, or a tree (K, S, N). Which one
yields the most tokens per second depends on the batch size (the cost of an iteration grows with
the tokens it verifies, and at large batches faster than the tokens it gains) and on how often
the draft is right. So, before each iteration, :func:`choose_plan` (a pure function of
:class:`PolicyInputs`) picks the shape that maximises

    expected tokens per iteration, summed over the batch / measured seconds per iteration

from a :class:`CostTable` measured at engine start-up per batch size (and at a short and a long
context: attention grows with the context, a tree's faster than a chain's), and each request's online
acceptance estimate (:class:`Acceptance`: the rate at which the d-th draft of a path is accepted
given the ones before it, per request, depth and shape family; one rate for every depth is the
geometric model of Leviathan et al., arXiv 2211.17192, section 3.5). It may
also hold some requests apart, to a cheaper shape or none, where running the batch as two
groups costs less than the tokens it loses (a request whose draft is poor at a batch size where
verifying its tree is not free). SGLang and vLLM adapt the draft length for the same reason.
Estimates are noisy, so the choice has hysteresis: a plan replaces the one in force only where
it is expected to be faster by a margin, and a request is held apart only on enough evidence.

:class:`AdaptiveSpeculation` is what the scheduler asks each step; it keeps the estimates and
re-plans when the batch changes and every few iterations.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import weakref
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import attrs

from phasegraph.phases.context import TreeShape, check_tree_shape, tokens_per_iteration
from phasegraph.runtime.errors import InvalidConfig


@attrs.frozen
class SpecShape:
    """One iteration's shape: ``num_steps`` 0 is ``off`` (no drafts), ``topk`` 1 a chain."""

    topk: int = 1
    num_steps: int = 0
    num_draft_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        values = (self.topk, self.num_steps, self.num_draft_tokens)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
            raise InvalidConfig(f"a speculation shape is three integers (topk, num_steps, num_draft_tokens); got {values}")
        if self.num_steps == 0:
            if values != (1, 0, 0):
                raise InvalidConfig(f"the shape without drafts is SpecShape() (topk 1, num_steps 0, "
                                    f"num_draft_tokens 0); got {values}")
            return
        problems = check_tree_shape(*values)
        if problems:
            raise InvalidConfig("speculation shape: " + "; ".join(problems))

    @classmethod
    def of(cls, tree: TreeShape | None) -> SpecShape:
        return OFF if tree is None else cls(tree.topk, tree.num_steps, tree.num_draft_tokens)

    @classmethod
    def chain(cls, num_steps: int) -> SpecShape:
        return cls(1, num_steps, num_steps + 1)

    @property
    def off(self) -> bool:
        return self.num_steps == 0

    @property
    def family(self) -> str:
        """``off``, ``chain`` or ``tree``: shapes of one family share an acceptance estimate."""
        return "off" if self.num_steps == 0 else ("chain" if self.topk == 1 else "tree")

    @property
    def tree(self) -> TreeShape | None:
        return None if self.off else TreeShape(self.topk, self.num_steps, self.num_draft_tokens)

    @property
    def accept_width(self) -> int:
        """The most tokens one iteration commits to a request (W = S + 1; 1 without drafts)."""
        return self.num_steps + 1

    @property
    def name(self) -> str:
        if self.off:
            return "off"
        if self.topk == 1 and self.num_draft_tokens == self.num_steps + 1:
            return f"chain S={self.num_steps}"
        return f"tree K={self.topk} S={self.num_steps} N={self.num_draft_tokens}"

    def __str__(self) -> str:
        return self.name


OFF = SpecShape()


def parse_shape(text: str) -> SpecShape:
    """``off``, ``chain:S`` or ``tree:K,S,N`` (the command line's form) as a SpecShape."""
    kind, _, rest = str(text).strip().partition(":")
    bad = InvalidConfig(f"a speculation shape is off, chain:S or tree:K,S,N; got {text!r}")
    try:
        if kind == "off" and not rest:
            return OFF
        if kind == "chain":
            return SpecShape.chain(int(rest))
        if kind == "tree":
            k, s, n = (int(x) for x in rest.split(","))
            return SpecShape(k, s, n)
    except ValueError:
        raise bad from None
    raise bad


def default_shapes(tree: TreeShape) -> tuple[SpecShape, ...]:
    """The shapes an engine configured with ``tree`` adapts over: off, a chain of 1, a chain
    of up to 3 and the configured shape (few, so that graph capture and start-up measurement
    stay cheap)."""
    shapes = [OFF, SpecShape.chain(1), SpecShape.chain(min(3, tree.num_steps)), SpecShape.of(tree)]
    return tuple(dict.fromkeys(shapes))


def max_tokens_per_iteration(shapes: Sequence[SpecShape], kv_lead: int) -> int:
    """KV positions past its committed length a request may write in one iteration of any shape."""
    return max(tokens_per_iteration(s.tree, kv_lead) for s in shapes)


# ------------------------------------------------------------------------------------ costs


def _rows(rows):
    return None if rows is None else tuple(map(tuple, rows))


@attrs.frozen
class CostTable:
    """Seconds per iteration of each shape at a few batch sizes, linear between them, and
    optionally at two contexts, linear in the context.

    ``seconds[i][j]``: shape ``shapes[i]`` at batch ``batches[j]`` (ascending), its requests
    holding ``context`` tokens each. ``long_seconds``, where given, the same at
    ``long_context`` tokens: a request's attention reads its whole context, so a table timed on
    short prompts underprices the shapes that verify more tokens once contexts grow. ``split_s``:
    what running a batch as two groups adds to the two groups' own iterations. Measured at
    engine start-up (:meth:`phasegraph.runtime.engine.Engine.measure_spec_costs`) or given
    (``EngineConfig.spec_costs``), which also names the shapes the engine adapts over.
    """

    shapes: tuple[SpecShape, ...] = attrs.field(converter=tuple)
    batches: tuple[int, ...] = attrs.field(converter=tuple)
    seconds: tuple[tuple[float, ...], ...] = attrs.field(converter=_rows)
    split_s: float = 0.0
    context: int = 16
    long_context: int | None = None
    long_seconds: tuple[tuple[float, ...], ...] | None = attrs.field(default=None, converter=_rows)

    def __attrs_post_init__(self) -> None:
        if not self.shapes or any(not isinstance(s, SpecShape) for s in self.shapes):
            raise InvalidConfig(f"CostTable.shapes must be a non-empty list of SpecShape; got {self.shapes!r}")
        if len(set(self.shapes)) != len(self.shapes):
            raise InvalidConfig(f"CostTable.shapes names a shape twice: {[s.name for s in self.shapes]}")
        b = self.batches
        if not b or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in b) or list(b) != sorted(set(b)):
            raise InvalidConfig(f"CostTable.batches must be ascending distinct batch sizes >= 1; got {b!r}")
        if len(self.seconds) != len(self.shapes) or any(len(row) != len(b) for row in self.seconds):
            raise InvalidConfig(f"CostTable.seconds must hold one row per shape ({len(self.shapes)}) of one "
                                f"value per batch size ({len(b)})")
        for shape, row in zip(self.shapes, self.seconds, strict=True):
            if any(not _positive(x) for x in row):
                raise InvalidConfig(f"CostTable: the seconds of {shape.name} must be positive and finite; got {row}")
        if isinstance(self.split_s, bool) or not isinstance(self.split_s, (int, float)) \
                or not (math.isfinite(self.split_s) and self.split_s >= 0):
            raise InvalidConfig(f"CostTable.split_s must be a number of seconds >= 0; got {self.split_s!r}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise InvalidConfig(f"CostTable.context must be a token count >= 1; got {self.context!r}")
        if (self.long_context is None) != (self.long_seconds is None):
            raise InvalidConfig("CostTable.long_context and long_seconds come together: give both or neither")
        if self.long_context is not None:
            if isinstance(self.long_context, bool) or not isinstance(self.long_context, int) \
                    or self.long_context <= self.context:
                raise InvalidConfig(f"CostTable.long_context must be a token count above context "
                                    f"({self.context}); got {self.long_context!r}")
            if len(self.long_seconds) != len(self.shapes) or any(len(r) != len(b) for r in self.long_seconds):
                raise InvalidConfig("CostTable.long_seconds must have the shape of seconds")
            for shape, row in zip(self.shapes, self.long_seconds, strict=True):
                if any(not _positive(x) for x in row):
                    raise InvalidConfig(f"CostTable: the long-context seconds of {shape.name} must be positive "
                                        f"and finite; got {row}")

    def index(self, shape: SpecShape) -> int:
        return self.shapes.index(shape)

    def cost(self, shape: int, batch: int, context: float | None = None) -> float:
        """Seconds of one iteration of ``shapes[shape]`` at ``batch`` requests of ``context``
        tokens each: linear between the measured batch sizes, the smallest's below them, and the
        last two's slope above; linear between the two contexts and beyond the long one (the
        short one's below it). Without a long-context table, or a context, the short one's."""
        short = self._at_batch(self.seconds[shape], batch)
        if self.long_seconds is None or context is None or context <= self.context:
            return short
        long = self._at_batch(self.long_seconds[shape], batch)
        frac = (context - self.context) / (self.long_context - self.context)
        return max(short + (long - short) * frac, short * 1e-3)

    def costs_up_to(self, shape: int, batch: int, context: float | None = None) -> tuple[float, ...]:
        """:meth:`cost` at every batch size 1 .. ``batch`` (index k - 1)."""
        short = _costs_up_to_batch(self.seconds[shape], self.batches, batch)
        if self.long_seconds is None or context is None or context <= self.context:
            return short
        long = _costs_up_to_batch(self.long_seconds[shape], self.batches, batch)
        frac = (context - self.context) / (self.long_context - self.context)
        out = []
        for s, lg in zip(short, long, strict=True):
            seconds, floor = s + (lg - s) * frac, s * 1e-3
            out.append(seconds if seconds >= floor else floor)  # max(), without a call per batch size
        return tuple(out)

    def _at_batch(self, row: tuple[float, ...], batch: int) -> float:
        b = self.batches
        if len(b) == 1 or batch <= b[0]:
            return row[0]
        j = min(bisect.bisect_left(b, batch), len(b) - 1)
        lo, hi = b[j - 1], b[j]
        return max(row[j - 1] + (row[j] - row[j - 1]) * (batch - lo) / (hi - lo), row[0] * 1e-3)

    def to_dict(self) -> dict:
        out = {"shapes": [s.name for s in self.shapes], "batches": list(self.batches),
               "seconds": [list(r) for r in self.seconds], "split_s": self.split_s, "context": self.context}
        if self.long_seconds is not None:
            out |= {"long_context": self.long_context, "long_seconds": [list(r) for r in self.long_seconds]}
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> CostTable:
        """The inverse of :meth:`to_dict` (shape names as :attr:`SpecShape.name` writes them)."""
        try:
            shapes = [_shape_of_name(n) for n in data["shapes"]]
            return cls(shapes, data["batches"], data["seconds"], data.get("split_s", 0.0),
                       data.get("context", 16), data.get("long_context"), data.get("long_seconds"))
        except (KeyError, TypeError) as exc:
            raise InvalidConfig(f"not a cost table ({exc!s})") from None


@functools.lru_cache(maxsize=256)
def _costs_up_to_batch(row: tuple[float, ...], batches: tuple[int, ...], batch: int) -> tuple[float, ...]:
    """``CostTable._at_batch(row, k)`` for k = 1 .. ``batch``, a segment between measured sizes at
    a time; kept, as the policy reads the same rows at the same batch sizes every plan."""
    b = batches
    if len(b) == 1:
        return (row[0],) * batch
    out = [row[0]] * min(batch, b[0])
    floor = row[0] * 1e-3
    for j in range(1, len(b)):
        lo, hi, start, rise = b[j - 1], b[j], row[j - 1], row[j] - row[j - 1]
        end = batch if j == len(b) - 1 else min(hi, batch)  # the last slope runs on
        out.extend([max(start + rise * (k - lo) / (hi - lo), floor) for k in range(lo + 1, end + 1)])
    return tuple(out)


def _positive(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _shape_of_name(name: str) -> SpecShape:
    if name == "off":
        return OFF
    words = dict(w.split("=") for w in name.split()[1:])
    if name.startswith("chain "):
        return SpecShape.chain(int(words["S"]))
    if name.startswith("tree "):
        return SpecShape(int(words["K"]), int(words["S"]), int(words["N"]))
    raise InvalidConfig(f"unknown shape name {name!r}")


# ------------------------------------------------------------------------------- acceptance

# prior per-depth acceptance rates where nothing was observed yet; weight of the engine-wide
# estimate in a request's own (in observations)
PRIOR_RATE = {"chain": 0.75, "tree": 0.8}
PRIOR_WEIGHT = 2.0
# a tree's miss rate per depth against a chain's, where only one family was observed
TREE_MISS = 0.7
# observations fade by this factor each time a new one arrives (a request's acceptance drifts
# with its text), and by HELD_DECAY per iteration it runs without drafts, so that a held request
# drifts back to the engine-wide estimate and is tried again
DECAY = 0.9
HELD_DECAY = 0.97
# hysteresis: a plan other than the current one must be this much faster (a fraction) to
# replace it, as estimates are noisy; a request is held apart only after this many
# (decayed) observations of its own
SWITCH_MARGIN = 0.05
MIN_EVIDENCE = 4.0
# the longest a steady batch keeps its plan unexamined (iterations)
MAX_REPLAN_EVERY = 32
# a batch that differs from the one its plan was chosen for by at most this fraction of its
# requests (those that left and those that joined) keeps the plan until its next examination,
# at most replan_every iterations later: under traffic the batch changes almost every
# iteration, and a full plan costs more host time than a few rows move the choice
SMALL_BATCH_CHANGE = 1 / 8


# the lazily decayed counts are brought back to their true scale once their factor falls below
# this, long before the growing increments could overflow
RESCALE_BELOW = 1e-100


class _DecayedCounts:
    """One family's observations, lazily decayed: the true weights are the stored ones times
    ``scale``, so that fading all of them is one multiplication. ``tried_to[t - 1]``: the paths
    tried to depth t (a try at each depth up to t), ``hit_to[h - 1]``: those whose first h
    drafts were accepted; the tries and hits at a depth are sums over the deeper paths, read
    far less often than a path is observed."""

    __slots__ = ("hit_to", "scale", "tried_to")

    def __init__(self) -> None:
        self.hit_to: list[float] = []
        self.tried_to: list[float] = []
        self.scale = 1.0

    def fade(self, factor: float) -> None:
        scale = self.scale * factor
        if scale < RESCALE_BELOW:
            self.rescale(scale)
        else:
            self.scale = scale

    def rescale(self, scale: float) -> None:
        """Fold ``scale`` (the new factor) into the stored weights."""
        self.hit_to = [h * scale for h in self.hit_to]
        self.tried_to = [t * scale for t in self.tried_to]
        self.scale = 1.0

    def counts(self) -> tuple[list[float], list[float]]:
        """The true hits and tries at depths 1, 2, ... (index d - 1)."""
        hits, tries, hit, tried = [], [], 0.0, 0.0
        for h, t in zip(reversed(self.hit_to), reversed(self.tried_to), strict=True):
            hit += h
            tried += t
            hits.append(hit)
            tries.append(tried)
        scale = self.scale
        return [h * scale for h in reversed(hits)], [t * scale for t in reversed(tries)]


@attrs.define
class Acceptance:
    """Acceptance by depth of one request (or the engine), per shape family: depth d of a path
    is a trial, an accepted d-th draft a hit (a path that stops before the shape's depth adds
    one miss at the depth after its last accepted draft; deeper depths were not tried).

    Observations fade by ``decay`` each time a new one of their family arrives; they are kept
    lazily decayed, by path (:class:`_DecayedCounts`), so that an observation costs the same
    at any depth."""

    decay: float = DECAY
    _counts: dict[str, _DecayedCounts] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def hits(self) -> dict[tuple[str, int], float]:
        """The decayed hits by (family, depth)."""
        return {(f, d): h for f, c in self._counts.items() for d, h in enumerate(c.counts()[0], 1)}

    @property
    def tries(self) -> dict[tuple[str, int], float]:
        """The decayed tries by (family, depth)."""
        return {(f, d): t for f, c in self._counts.items() for d, t in enumerate(c.counts()[1], 1)}

    def observe(self, family: str, depth: int, accepted: int) -> None:
        """One iteration that drafted ``depth`` tokens on a path and accepted ``accepted``."""
        if depth <= 0:
            return
        counts = self._counts.get(family)
        if counts is None:
            counts = self._counts[family] = _DecayedCounts()
        counts.fade(self.decay)
        step = 1.0 / counts.scale  # one observation's weight, at the stored scale
        accepted = 0 if accepted < 0 else depth if accepted > depth else accepted
        tried = accepted + 1 if accepted < depth else depth
        tried_to = counts.tried_to
        if len(tried_to) < tried:
            counts.hit_to.extend([0.0] * (tried - len(tried_to)))
            tried_to.extend([0.0] * (tried - len(tried_to)))
        tried_to[tried - 1] += step
        if accepted:
            counts.hit_to[accepted - 1] += step

    def fade(self, factor: float) -> None:
        for counts in self._counts.values():
            counts.fade(factor)

    def rate(self, family: str, depth: int, prior: float) -> float:
        """The acceptance rate at ``depth``, the ``prior`` weighing PRIOR_WEIGHT trials."""
        counts = self._counts.get(family)
        hits, tries = counts.counts() if counts is not None else ((), ())
        hit, tried = (hits[depth - 1], tries[depth - 1]) if 0 < depth <= len(tries) else (0.0, 0.0)
        return (hit + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)

    def observed_rates(self, family: str, priors: Sequence[float]) -> list[float | None]:
        """:meth:`rate` at depths 1, 2, ... (one of ``priors`` each), None where never observed."""
        out: list[float | None] = [None] * len(priors)
        counts = self._counts.get(family)
        if counts is None:
            return out
        # the counts at a depth sum the paths that reached it: deepest first (as counts() does)
        scale, hit_to, tried_to, hit, tried = counts.scale, counts.hit_to, counts.tried_to, 0.0, 0.0
        for i in range(len(tried_to) - 1, -1, -1):
            hit += hit_to[i]
            tried += tried_to[i]
            tries = tried * scale
            if i < len(priors) and tries > 0:
                out[i] = (hit * scale + PRIOR_WEIGHT * priors[i]) / (tries + PRIOR_WEIGHT)
        return out

    def observed(self, family: str, depth: int) -> bool:
        counts = self._counts.get(family)
        tries = counts.counts()[1] if counts is not None else ()
        return 0 < depth <= len(tries) and tries[depth - 1] > 0

    def evidence(self) -> float:
        """Observations (decayed) behind the estimate: the tries of the first draft."""
        return sum(sum(c.tried_to) * c.scale for c in self._counts.values())


_OTHER = {"chain": "tree", "tree": "chain"}


def _convert(rate: float, to: str) -> float:
    """An acceptance rate of one family as the other's (TREE_MISS: a tree misses less)."""
    miss = (1 - rate) * TREE_MISS if to == "tree" else (1 - rate) / TREE_MISS
    hit = 1 - miss
    return 0.999 if hit > 0.999 else 0.01 if hit < 0.01 else hit  # within [0.01, 0.999]


def _own_else_derived(own: list[float | None], other: list[float | None], family: str,
                      fallback: list[float]) -> list[float]:
    """Per depth: the ``own`` family's rate, else the other family's as this one's, else ``fallback``."""
    out = []
    for mine, theirs, back in zip(own, other, fallback, strict=True):
        out.append(mine if mine is not None else back if theirs is None else _convert(theirs, family))
    return out


def expected_tokens(rates: float | Sequence[float], depth: int) -> float:
    """Tokens an iteration of ``depth`` drafts emits (the bonus included), the d-th draft
    accepted with probability ``rates[d-1]`` given the ones before it (one ``rate`` for every
    depth: 1 + rate + ... + rate**depth)."""
    if not isinstance(rates, Sequence):
        rates = [rates] * max(depth, 0)
    total, path = 1.0, 1.0
    for d in range(max(depth, 0)):
        path *= rates[d]
        total += path
    return total


# ---------------------------------------------------------------------------------- policy


@attrs.frozen
class PolicyInputs:
    """What the policy sees: the costs, and per request (row) the tokens each shape is expected
    to emit for it per iteration (1 for ``off``; a request's draft cap already applied).

    Hysteresis: ``current`` is the plan the batch runs now (its rows in this batch's order), which
    another plan replaces only where it is expected to be ``margin`` (a fraction) faster; a
    split must be that much faster than the best whole-batch plan too. ``evidence``: the
    observations behind each row's estimate; a row with fewer than ``min_evidence`` is not held
    apart unless it already is (one iteration's luck splits no batch). ``context``: the rows'
    mean context, at which the costs are read."""

    costs: CostTable
    expected: tuple[tuple[float, ...], ...] = attrs.field(converter=lambda rows: tuple(map(tuple, rows)))
    split: bool = True  # may the batch run as two groups
    current: Plan | None = None
    margin: float = 0.0
    evidence: tuple[float, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    min_evidence: float = 0.0
    context: float | None = None  # the rows' mean context in tokens (costs are priced at it)

    def __attrs_post_init__(self) -> None:
        n, B = len(self.costs.shapes), len(self.expected)
        if any(len(row) != n for row in self.expected):
            raise InvalidConfig(f"PolicyInputs.expected: every row needs one value per shape ({n})")
        for name in ("margin", "min_evidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidConfig(f"PolicyInputs.{name} must be a number >= 0; got {value!r}")
        ctx = self.context
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, (int, float)) or not ctx >= 0):
            raise InvalidConfig(f"PolicyInputs.context must be a token count >= 0 or None; got {ctx!r}")
        if self.evidence is not None and len(self.evidence) != B:
            raise InvalidConfig(f"PolicyInputs.evidence needs one value per row ({B}); got {len(self.evidence)}")
        c = self.current
        if c is not None and (not 0 <= c.shape < n or any(not 0 <= r < B for r in c.held)
                              or (c.held and (c.held_shape is None or not 0 <= c.held_shape < n))):
            raise InvalidConfig(f"PolicyInputs.current names shapes or rows it does not have: {c!r}")


@attrs.frozen
class Plan:
    """The policy's choice: the batch runs ``shape`` (an index into the cost table's shapes),
    except the rows ``held``, which run apart in ``held_shape``."""

    shape: int
    held: tuple[int, ...] = ()
    held_shape: int | None = None
    tokens_per_s: float = 0.0

    def describe(self, shapes: Sequence[SpecShape]) -> str:
        text = shapes[self.shape].name
        if self.held:
            text += f" | {len(self.held)} held: {shapes[self.held_shape].name}"
        return text


def choose_plan(inputs: PolicyInputs) -> Plan:
    """The plan with the most expected tokens per second (every shape for the whole batch, and
    with ``split`` every shape with the rows that gain least from it held to a cheaper one),
    unless it beats ``current`` by less than ``margin``: then ``current``."""
    if not inputs.expected:
        return Plan(0, tokens_per_s=-1.0)
    whole = _best_whole(inputs)
    best = _best_split(inputs, whole) if inputs.split and len(inputs.expected) >= 2 else whole
    if inputs.current is None:
        return best
    c = inputs.current
    current = Plan(c.shape, c.held, c.held_shape, _rate_of(inputs, c))  # (attrs.evolve, without its cost)
    return best if best.tokens_per_s > current.tokens_per_s * (1 + inputs.margin) else current


def _rate_of(inputs: PolicyInputs, plan: Plan) -> float:
    """Expected tokens per second of ``plan`` for these rows."""
    costs, rows = inputs.costs, inputs.expected
    ctx = inputs.context
    if not plan.held:
        return sum(map(operator.itemgetter(plan.shape), rows)) / costs.cost(plan.shape, len(rows), ctx)
    held = set(plan.held)
    kept = [r for i, r in enumerate(rows) if i not in held]
    tokens = sum(r[plan.shape] for r in kept) + sum(rows[i][plan.held_shape] for i in held)
    seconds = costs.cost(plan.held_shape, len(held), ctx) + costs.split_s
    return tokens / (seconds + (costs.cost(plan.shape, len(kept), ctx) if kept else 0.0))


def _holdable(inputs: PolicyInputs) -> list[bool]:
    """Whether each row may run apart: its estimate has the evidence, or it is held already."""
    if inputs.evidence is None:
        return [True] * len(inputs.expected)
    held = set(inputs.current.held) if inputs.current is not None else set()
    least = inputs.min_evidence
    return [n >= least or row in held for row, n in enumerate(inputs.evidence)]


def _best_whole(inputs: PolicyInputs) -> Plan:
    """The fastest single shape for the whole batch (the first of equals)."""
    plans = (Plan(i, tokens_per_s=_rate_of(inputs, Plan(i))) for i in range(len(inputs.costs.shapes)))
    return max(plans, key=lambda plan: plan.tokens_per_s)


def _best_split(inputs: PolicyInputs, whole: Plan) -> Plan:
    """``whole``, or the fastest split that beats it by ``margin``: for each pair of shapes the
    rows that gain most from the dearer one run it, the rest (those with the evidence) the
    cheaper one. Each group pays its own iteration (fixed cost included) plus ``split_s``."""
    costs, rows = inputs.costs, inputs.expected
    B, shapes = len(rows), costs.shapes
    # cost of each shape at every group size 1..B-1, computed once
    at = [(0.0, *costs.costs_up_to(i, B - 1, inputs.context)) for i in range(len(shapes))]
    holdable = _holdable(inputs)
    pinned = B - sum(holdable)  # rows that must stay in the batch
    first = max(pinned, 1)  # the fewest rows that run shape a
    columns = list(zip(*rows, strict=True))  # each shape's expected tokens, row by row
    best, bar = whole, whole.tokens_per_s * (1 + inputs.margin)
    for a in range(len(shapes)):
        for h in range(len(shapes)):
            if h == a or at[h][B - 1] >= at[a][B - 1]:
                continue  # a group is held to a cheaper shape only
            # the rows that may not be held first, then those that gain most from shape a
            gain_a, gain_h = columns[a], columns[h]
            gains = list(map(operator.sub, gain_a, gain_h))
            keys = gains if not pinned else [(not holdable[r], gains[r]) for r in range(B)]
            order = sorted(range(B), key=keys.__getitem__, reverse=True)
            kept = sum(map(gain_a.__getitem__, order[: first - 1]))
            held = sum(map(gain_h.__getitem__, order[first - 1 :]))
            cost_a, cost_h, split_s = at[a], at[h], costs.split_s
            top, found = max(best.tokens_per_s, bar), 0  # a split must beat both
            for k in range(first, B):  # the first k rows run shape a, the rest shape h
                r = order[k - 1]
                kept += gain_a[r]
                held -= gain_h[r]
                rate = (kept + held) / (cost_a[k] + cost_h[B - k] + split_s)
                if rate > top:
                    top, found = rate, k
            if found:
                best = Plan(a, tuple(sorted(order[found:])), h, top)
    return best


def _same_plan(a: Plan, b: Plan) -> bool:
    return (a.shape, a.held, a.held_shape) == (b.shape, b.held, b.held_shape)


class _InForce(NamedTuple):
    """The plan in force: the batch it last ran for (request ids), the iterations since it was
    chosen, how many it runs before it is examined again, and the requests it was chosen for."""

    key: tuple[int, ...]
    plan: Plan
    since: int
    interval: int
    planned: frozenset[int]


class AdaptiveSpeculation:
    """The scheduler's policy state: the cost table, every request's acceptance, the plan of
    the current batch (re-chosen when the batch changes by more than
    :data:`SMALL_BATCH_CHANGE`, and after ``replan_every`` iterations; each re-choice that
    keeps the plan doubles that interval, up to ``max_replan_every``, so that a steady batch
    pays for few plans)."""

    def __init__(self, costs: CostTable, *, split: bool = True, replan_every: int = 8,
                 max_replan_every: int = MAX_REPLAN_EVERY,
                 margin: float = SWITCH_MARGIN, min_evidence: float = MIN_EVIDENCE):
        self.costs = costs
        self.shapes = costs.shapes
        self.depth = max(s.num_steps for s in costs.shapes)  # the deepest shape's drafts
        self.split = split
        self.replan_every = replan_every
        self.max_replan_every = max(replan_every, max_replan_every)
        self.margin = margin
        self.min_evidence = min_evidence
        # the plan in force: its shape, and the requests it holds apart in its held shape
        self._shape: int | None = None
        self._held_shape: int | None = None
        self._held: weakref.WeakSet = weakref.WeakSet()
        self.force: SpecShape | None = None  # run this shape, whatever the policy says (measurement)
        # or (measurement of a split) this pair of shape indices: the batch's first half runs the
        # first, its second half the other, however many requests are still running
        self.fixed_split: tuple[int, int] | None = None
        self.engine_wide = Acceptance(decay=0.98)
        # each shape's family and its number of drafts, and the estimate of a request that never drafts
        self._drafts = [(s.family, s.num_steps) for s in costs.shapes]
        self._no_drafts = (1.0,) * len(costs.shapes)
        self._requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last: _InForce | None = None
        self.plans = 0  # plans chosen (not reused)

    def acceptance(self, req) -> Acceptance:
        a = self._requests.get(req)
        if a is None:
            a = self._requests[req] = Acceptance()
        return a

    def engine_rate(self, family: str, depth: int) -> float:
        """The engine-wide acceptance of a family at a depth: observed, else the other family's
        there, else the depth above's, else a prior."""
        return self._engine_rates(depth)[family][depth - 1] if depth >= 1 else PRIOR_RATE[family]

    def _engine_rates(self, depth: int) -> dict[str, list[float]]:
        """:meth:`engine_rate` of each family at depths 1 .. ``depth`` (index d - 1)."""
        e = self.engine_wide
        observed = {f: e.observed_rates(f, [PRIOR_RATE[f]] * depth) for f in _OTHER}
        out: dict[str, list[float]] = {}
        for f, other in _OTHER.items():
            rates, above = [], PRIOR_RATE[f]
            for own, theirs in zip(observed[f], observed[other], strict=True):
                above = own if own is not None else _convert(theirs, f) if theirs is not None else above
                rates.append(above)
            out[f] = rates
        return out

    def rates(self, req) -> dict[str, list[float]]:
        """``req``'s acceptance per family and depth (1 .. the deepest shape): its own
        observations weighed with the engine's estimate; a family it never ran at a depth
        derived from the one it ran there."""
        return self._rates_of(self.acceptance(req), self._engine_rates(self.depth))

    @staticmethod
    def _rates_of(a: Acceptance, engine: dict[str, list[float]]) -> dict[str, list[float]]:
        """:meth:`rates` of the acceptance ``a``, given the engine's (the same for a whole batch)."""
        chain, tree = a.observed_rates("chain", engine["chain"]), a.observed_rates("tree", engine["tree"])
        return {"chain": _own_else_derived(chain, tree, "chain", engine["chain"]),
                "tree": _own_else_derived(tree, chain, "tree", engine["tree"])}

    def expected(self, req, engine: dict[str, list[float]] | None = None) -> tuple[float, ...]:
        """Tokens each shape is expected to emit for ``req`` per iteration; ``engine``: the
        engine-wide rates (:meth:`_engine_rates`), computed here where not given."""
        cap = req.params.draft_cap
        if cap == 0:
            return self._no_drafts
        engine = self._engine_rates(self.depth) if engine is None else engine
        # expected_tokens at every depth at once: its running sums, family by family
        totals = {"off": [1.0]}
        for f, rates in self._rates_of(self.acceptance(req), engine).items():
            total, path, sums = 1.0, 1.0, [1.0]
            for rate in rates:
                path *= rate
                total += path
                sums.append(total)
            totals[f] = sums
        return tuple([totals[f][steps if cap is None else max(min(steps, cap), 0)] for f, steps in self._drafts])

    def plan(self, batch: Sequence) -> Plan:
        if self.force is not None:
            return Plan(self.shapes.index(self.force))
        if self.fixed_split is not None:
            kept, held = self.fixed_split
            half = len(batch) // 2
            return Plan(kept, tuple(range(len(batch) - half, len(batch))), held) if half else Plan(kept)
        key = tuple(map(id, batch))
        last = self._last
        if last is not None and last.since < last.interval:
            if last.key == key:
                self._last = last._replace(since=last.since + 1)
                return last.plan
            changed = len(last.planned.symmetric_difference(key))  # requests that left or joined
            if not last.plan.held and changed <= len(last.planned) * SMALL_BATCH_CHANGE:
                # (a plan that holds rows apart names them: it is chosen again for other rows)
                self._last = last._replace(key=key, since=last.since + 1,
                                           interval=min(last.interval, self.replan_every))
                return last.plan
        plan = choose_plan(self.inputs(batch))
        interval = self.replan_every
        if last is not None and last.key == key and _same_plan(plan, last.plan):
            interval = min(2 * last.interval, self.max_replan_every)
        self._last = _InForce(key, plan, 1, interval, frozenset(key))
        self._shape, self._held_shape = plan.shape, plan.held_shape
        self._held = weakref.WeakSet(batch[i] for i in plan.held)
        self.plans += 1
        return plan

    def inputs(self, batch: Sequence) -> PolicyInputs:
        """The policy's inputs for ``batch``: its estimates, and the plan in force in its rows."""
        context = sum(r.seq_len for r in batch) / len(batch) if batch else None
        engine = self._engine_rates(self.depth)  # one engine-wide estimate for the whole batch
        return PolicyInputs(self.costs, [self.expected(r, engine) for r in batch], self.split, self.current(batch),
                            self.margin, [self.evidence(r) for r in batch], self.min_evidence, context)

    def current(self, batch: Sequence) -> Plan | None:
        """The plan in force, over ``batch``'s rows (None before the first)."""
        if self._shape is None:
            return None
        if not self._held:
            return Plan(self._shape)
        held = tuple(i for i, r in enumerate(batch) if r in self._held)
        if held and len(held) == len(batch):  # the rest left: the held group is the batch
            return Plan(self._held_shape)
        return Plan(self._shape, held, self._held_shape) if held else Plan(self._shape)

    def evidence(self, req) -> float:
        """Observations behind ``req``'s estimate (a request that never drafts needs none)."""
        return math.inf if req.params.draft_cap == 0 else self.acceptance(req).evidence()

    def observe(self, req, shape: SpecShape, accept_length: int) -> None:
        """A verify of ``shape`` accepted ``accept_length`` tokens (bonus included) for ``req``."""
        a = self.acceptance(req)
        cap, depth, family = req.params.draft_cap, shape.num_steps, shape.family
        if cap is not None and cap < depth:
            depth = cap
        a.observe(family, depth, accept_length - 1)
        self.engine_wide.observe(family, depth, accept_length - 1)

    def batch_ran_without_drafts(self) -> None:
        """No request drafted this iteration, so nothing was observed: the engine's estimate
        fades toward the prior, so that a policy that chose ``off`` tries speculation again
        (one that never drafts would never learn that drafting pays again)."""
        self.engine_wide.fade(HELD_DECAY)

    def ran_without_drafts(self, req) -> None:
        """``req`` ran an iteration without drafts: nothing was observed, so its estimate fades
        (decode kept its draft state current, so its next draft counts as any other)."""
        self.acceptance(req).fade(HELD_DECAY)
