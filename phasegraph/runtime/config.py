"""The public configuration and result types: SpecConfig, SamplingParams, RequestOutput.

Every constructor checks its arguments and raises :class:`InvalidRequest` (a ``ValueError``)
with a message that names the argument, so bad input never reaches a phase.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from phasegraph.phases.context import TreeShape, check_tree_shape, num_tree_candidates
from phasegraph.runtime.adaptive import CostTable
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest
from phasegraph.runtime.grammar import (
    GRAMMAR_KINDS,
    InvalidGrammar,
    canonical_json_schema,
    compile_grammar,
)
from phasegraph.runtime.methods import BUILT_IN, method_names

METHODS = BUILT_IN  # and the registered ones (runtime/methods.py: method_names())
# SpecConfig's bounds (see its docstring): far above any published EAGLE tree, low enough that
# the tree's tensors stay small and no count overflows on its way into torch
MAX_NUM_STEPS, MAX_TOPK, MAX_NUM_DRAFT_TOKENS, MAX_TREE_CANDIDATES = 64, 128, 1024, 32768


@attrs.frozen
class SpecConfig:
    """How to speculate.

    ``method``: ``"none"`` (the target alone: the autoregressive baseline), ``"eagle"``
    (EAGLE-1 head), ``"eagle3"``, ``"mtp"`` (chained multi-token-prediction layers),
    ``"standalone"`` (a small draft model with the target's vocabulary), ``"ngram"`` (prompt
    lookup: no draft model) or a method registered with
    :func:`~phasegraph.runtime.methods.register_method`. ``num_steps`` (S) is the
    tree depth, ``topk`` (K) the branching per step (1 = chain), ``num_draft_tokens`` (N) the
    tree nodes verified per request including the root (default: S+1 for a chain, else
    min(K·S, 16) + 1 capped by what the tree can hold).

    Bounds (:class:`InvalidConfig` past them; published EAGLE trees stay far below, e.g. S <= 10,
    K <= 10, N <= 64): S <= 64, K <= 128, N <= 1024, and at most 32768 draft candidates
    K + (S-1)·K² per request, so the tree's tensors stay small ([B, candidates], [B, N, N]).

    ``adaptive``: before each iteration choose among a few shapes (no drafts, chains, this
    shape) the one with the most expected tokens per second, from costs measured per batch
    size at start-up and each request's acceptance (docs/usage.md#adaptive-speculation). None
    (the default): on for an engine on a GPU, or given ``EngineConfig.spec_costs``, without
    tensor parallelism; True: also on a CPU or split over ranks (the costs are measured at
    start-up unless ``spec_costs`` gives them; split, rank 0's timings are every rank's);
    False: every iteration runs this shape.
    """

    method: str = "eagle3"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    adaptive: bool | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in method_names():
            raise InvalidConfig(f"SpecConfig.method must be one of {', '.join(method_names())}; got {self.method!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise InvalidConfig(f"SpecConfig.adaptive must be True, False or None (auto); got {self.adaptive!r}")
        if self.method == "none":
            return
        for name, most in (("num_steps", MAX_NUM_STEPS), ("topk", MAX_TOPK)):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= most:
                raise InvalidConfig(f"SpecConfig.{name} must be an integer in [1, {most}]; got {v!r}")
        candidates = num_tree_candidates(self.topk, self.num_steps)
        if candidates > MAX_TREE_CANDIDATES:
            raise InvalidConfig(
                f"SpecConfig: topk={self.topk}, num_steps={self.num_steps} drafts {candidates} candidates "
                f"per request (K + (S-1)·K²); at most {MAX_TREE_CANDIDATES}: lower topk or num_steps"
            )
        n = self.num_draft_tokens
        if n is None:
            object.__setattr__(self, "num_draft_tokens", self.default_num_draft_tokens())
        elif not is_int(n):
            raise InvalidConfig(f"SpecConfig.num_draft_tokens must be an integer; got {n!r}")
        elif n > MAX_NUM_DRAFT_TOKENS:
            raise InvalidConfig(
                f"SpecConfig.num_draft_tokens must be at most {MAX_NUM_DRAFT_TOKENS}; got {n!r}"
            )
        problems = check_tree_shape(self.topk, self.num_steps, self.num_draft_tokens)
        if problems:
            raise InvalidConfig("SpecConfig: " + "; ".join(problems))

    def default_num_draft_tokens(self) -> int:
        if self.topk == 1:
            return self.num_steps + 1
        most = num_tree_candidates(self.topk, self.num_steps)
        return min(self.topk * self.num_steps, 16, most) + 1

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    def tree(self) -> TreeShape | None:
        if not self.speculative:
            return None
        return TreeShape(self.topk, self.num_steps, self.num_draft_tokens)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# temperatures in (0, GREEDY_BELOW) are greedy (temperature 0)
GREEDY_BELOW = 1e-5


def _as_tuple(name: str, v: object, what: str) -> tuple:
    """``v`` (None or any iterable but a mapping) as a tuple."""
    if v is None:
        return ()
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Iterable):
        raise InvalidRequest(f"{name} must be {what}; got {v!r}")
    return tuple(v)


def is_int(v: object) -> bool:
    """``v`` is a Python int and not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _finite_number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"{name} must be a number; got {v!r}")
    f = float(v)
    if math.isnan(f) or math.isinf(f):
        raise InvalidRequest(f"{name} must be finite; got {v!r}")
    return f


# the most top logprobs a request may ask for per position (OpenAI's and vLLM's bound)
MAX_LOGPROBS = 20
# OpenAI's ranges of the frequency and presence penalties and of a logit bias
PENALTY_RANGE, LOGIT_BIAS_RANGE = 2.0, 100.0


@attrs.frozen
class SamplingParams:
    """Per-request generation settings.

    ``temperature`` 0 is greedy (so is any below 1e-5). ``top_p`` in (0, 1], ``top_k`` 0 = off. Generation stops at
    ``max_new_tokens``, at an EOS token (unless ``ignore_eos``), at any of ``stop_token_ids``, or
    when the text contains one of ``stop`` (the text is cut before it). ``seed`` makes sampling
    reproducible whatever the batch (and across retraction).

    Logprobs are ``log_softmax`` of the target's raw logits (before temperature, top-k/top-p,
    min_p, bias and penalties), at the same positions whether or not the engine speculates.
    ``logprobs``: False (or None) for none; True (or 0) for each emitted token's logprob
    (``RequestOutput.logprobs``); an integer k in [1, 20] adds the k most likely tokens at each
    generated position (``RequestOutput.top_logprobs``: (token id, logprob) pairs, most likely
    first). ``prompt_logprobs``: None, or k in [0, 20] for the logprob of every prompt token
    after the first and the k most likely tokens at each of those positions
    (``RequestOutput.prompt_logprobs`` / ``prompt_top_logprobs``, entry 0 None).

    Logit processing, in this order and before everything else (greedy decoding too):
    ``logit_bias`` ({token id: bias in [-100, 100]}) is added to the logits; then
    ``repetition_penalty`` (> 0, 1 = off; the CTRL / Hugging Face form) divides the positive and
    multiplies the other logits of every token that occurs in the prompt or the output; then
    ``frequency_penalty`` (in [-2, 2]) is subtracted once per time a token was emitted and
    ``presence_penalty`` (in [-2, 2]) once if it was emitted at all (OpenAI's definitions, over
    the output only). Under speculation each draft-tree node is penalised from its own
    ancestry: the output so far plus the drafted tokens on its path. After temperature, top-k
    and top-p, ``min_p`` (in [0, 1], 0 = off) keeps the tokens whose probability is at least
    ``min_p`` times the most likely token's.

    ``return_routed_experts`` (MoE targets only; a dense target refuses the request): for each
    generated token, the expert ids each MoE layer chose at the forward row whose logits gave
    that token (``RequestOutput.routed_experts``: one ``[num_moe_layers][k]`` list per token),
    the same under speculation as without.

    ``speculate``: False runs the request without drafts (one token per iteration, verified by
    the target like any other) inside a speculative batch; ``max_draft_tokens`` (an integer
    >= 0, None = the engine's shape) caps the drafted tokens it may accept per iteration. Either
    way its output stays exactly the target's; without speculation both are ignored.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool | int | None = False
    seed: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # {token id: bias}; kept as (token id, bias) pairs in id order, so the params stay hashable
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    return_routed_experts: bool = False
    speculate: bool = True
    max_draft_tokens: int | None = None
    # structured output, at most one of them (phasegraph.runtime.grammar); the schema is kept as JSON text
    json_schema: Mapping | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __attrs_post_init__(self) -> None:
        m = self.max_new_tokens
        if not is_int(m) or m < 1:
            raise InvalidRequest(f"max_new_tokens must be an integer >= 1; got {m!r}")
        t = _finite_number("temperature", self.temperature)
        if t < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy); got {self.temperature!r}")
        p = _finite_number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1]; got {self.top_p!r}")
        k = self.top_k
        if not is_int(k) or not 0 <= k <= INT64_MAX:
            raise InvalidRequest(f"top_k must be an integer in [0, 2**63) (0 = off); got {k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        stops = _as_tuple("stop", self.stop, "a string or a list of strings")
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise InvalidRequest(f"stop must be non-empty strings; got {stops!r}")
        object.__setattr__(self, "stop", stops)
        ids = _as_tuple("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if any(not is_int(i) or not 0 <= i <= INT64_MAX for i in ids):  # they travel as int64
            raise InvalidRequest(f"stop_token_ids must be non-negative integers below 2**63; got {ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        seed = self.seed  # the per-request seed travels to the device as an int64
        if seed is not None and (not is_int(seed) or not INT64_MIN <= seed <= INT64_MAX):
            raise InvalidRequest(f"seed must be a 64-bit integer (in [-2**63, 2**63)) or None; got {seed!r}")
        if not isinstance(self.ignore_eos, bool):  # a truthy string such as "no" would flip it
            raise InvalidRequest(f"ignore_eos must be True or False; got {self.ignore_eos!r}")
        if not isinstance(self.return_routed_experts, bool):
            raise InvalidRequest(f"return_routed_experts must be True or False; got {self.return_routed_experts!r}")
        self._check_logprobs()
        self._check_logit_processing()
        self._check_speculation()
        self._check_structured_output()
        if 0 < t < GREEDY_BELOW:
            # logits / t overflows float32 for a tiny t (NaN probabilities, garbage tokens);
            # sampling that cold is greedy decoding in all but ties (as in vLLM)
            t = 0.0
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)

    def _check_logprobs(self) -> None:
        lp = self.logprobs
        if lp is None:
            lp = False
        elif not isinstance(lp, bool) and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise InvalidRequest(
                f"logprobs must be True or False, or an integer in [0, {MAX_LOGPROBS}] (the top "
                f"logprobs per generated position); got {lp!r}"
            )
        object.__setattr__(self, "logprobs", True if lp == 0 and not isinstance(lp, bool) else lp)
        k = self.prompt_logprobs
        if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequest(
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (the top logprobs "
                f"per prompt position); got {k!r}"
            )

    def _check_speculation(self) -> None:
        if not isinstance(self.speculate, bool):
            raise InvalidRequest(f"speculate must be True or False; got {self.speculate!r}")
        cap = self.max_draft_tokens
        if cap is not None and (not is_int(cap) or not 0 <= cap <= MAX_NUM_DRAFT_TOKENS):
            raise InvalidRequest(
                f"max_draft_tokens must be None or an integer in [0, {MAX_NUM_DRAFT_TOKENS}] (drafted tokens "
                f"a request may accept per iteration); got {cap!r}"
            )

    @property
    def draft_cap(self) -> int | None:
        """The most drafted tokens this request accepts per iteration (None: no cap of its own)."""
        return 0 if not self.speculate else self.max_draft_tokens

    def _check_logit_processing(self) -> None:
        m = _finite_number("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off); got {self.min_p!r}")
        object.__setattr__(self, "min_p", m)
        r = _finite_number("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0 (1 = off); got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", r)
        for name in ("frequency_penalty", "presence_penalty"):
            f = _finite_number(name, getattr(self, name))
            if not -PENALTY_RANGE <= f <= PENALTY_RANGE:
                raise InvalidRequest(f"{name} must be in [-2, 2] (0 = off); got {getattr(self, name)!r}")
            object.__setattr__(self, name, f)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    def _check_structured_output(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidGrammar(f"at most one of json_schema, regex and grammar; got {', '.join(given)}")
        if not given:
            return
        kind = given[0]
        if kind == "json_schema":
            object.__setattr__(self, "json_schema", canonical_json_schema(self.json_schema))
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise InvalidGrammar(f"{kind} must be a non-empty string; got {getattr(self, kind)!r}")
        compile_grammar(kind, getattr(self, kind))  # a spec that does not parse fails here, before anything runs

    @property
    def structured_output(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's grammar, or None."""
        for k in GRAMMAR_KINDS:
            if getattr(self, k) is not None:
                return k, getattr(self, k)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """The emitted tokens' logprobs are asked for."""
        return self.logprobs is not False

    @property
    def top_logprobs(self) -> int:
        """Top logprobs per generated position (0: none)."""
        return 0 if isinstance(self.logprobs, bool) else self.logprobs

    @property
    def uses_penalties(self) -> bool:
        """A logit bias or a penalty changes the logits."""
        return (self.logit_bias is not None or self.repetition_penalty != 1.0
                or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """A logit bias as (token id, bias) pairs in id order (None for none), each checked."""
    if bias is None:
        return None
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in bias):
        pairs = list(bias)  # the form it is kept in
    else:
        raise InvalidRequest(f"logit_bias must be a mapping of token ids to biases; got {bias!r}")
    for token, value in pairs:
        if not is_int(token) or not 0 <= token <= INT64_MAX:
            raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers); got {token!r}")
        v = _finite_number(f"logit_bias[{token}]", value)
        if not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
            raise InvalidRequest(f"logit_bias[{token}] must be in [-100, 100]; got {value!r}")
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"logit_bias names a token twice: {sorted(ids)}")
    return tuple(sorted((int(t), float(v)) for t, v in pairs)) or None


# Upper bounds of the engine's sizes: far above any real setting (past them, Python ints
# overflowed inside torch); KV slot ids and positions stay below 2**31. Sizes within them that do
# not fit in memory are refused when the KV cache is allocated.
MAX_PAGE_SIZE = 1 << 16
MAX_BATCH_SIZE = 1 << 16
MAX_KV_TOKENS = (1 << 31) - 1
# "phase": one graph per phase and bucket; "iteration": the four phases of a speculative
# iteration as one graph (runtime/iteration_graph.py), per-phase graphs as fallback
GRAPH_SCOPES = ("phase", "iteration")


def as_spec(spec: SpecConfig | str | None) -> SpecConfig:
    """``spec`` as a SpecConfig: None is the target alone, a string names the method."""
    if spec is None:
        return SpecConfig(method="none")
    if isinstance(spec, str):
        return SpecConfig(method=spec)
    if not isinstance(spec, SpecConfig):
        raise InvalidConfig(f"spec must be a SpecConfig (or a method name); got {type(spec).__name__}")
    return spec


def _switch(*extras: object):
    """A validator: True or False, or one of ``extras`` (a truthy string such as "no" would
    silently turn a switch on)."""
    def check(_, attribute, value) -> None:
        if isinstance(value, bool) or any(value is e or (isinstance(e, str) and value == e) for e in extras):
            return
        allowed = ", ".join(["True", "False", *map(repr, extras)])
        raise InvalidConfig(f"{attribute.name} must be one of {allowed}; got {value!r}")
    return check


def _count(most: int, none: str | None = None):
    """A validator: an integer in [1, most], or None where ``none`` says what None means."""
    def check(_, attribute, value) -> None:
        if value is None and none is not None:
            return
        if not is_int(value) or not 1 <= value <= most:
            why = f" (or None: {none})" if none is not None else ""
            raise InvalidConfig(f"{attribute.name} must be an integer in [1, {most}]{why}; got {value!r}")
    return check


def _token_ids(value):
    """A list of ids as a tuple; anything else is kept as given, for the engine to refuse by name."""
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return value


TP_ALL_REDUCES = ("nccl", "symm_mem")
TP_REDUCE_DTYPES = ("float32", "model")
# the drafts that run fused decoder layers, which runtime/models/fused_decoder.py splits
DRAFT_TP_METHODS = ("standalone", "eagle3")
# long enough for ranks that load a large checkpoint at different speeds to meet at the first
# collective; a dead rank is noticed sooner (the liveness check, or gloo's closed connection)
DEFAULT_TP_TIMEOUT_S = 300.0


@attrs.frozen
class EngineConfig:
    """Every option of an :class:`~phasegraph.runtime.engine.Engine`, each checked when the
    config is made (:class:`InvalidConfig` naming the option); the checks that need the models
    (vocabulary, context length) run when the engine is built.

    ``spec``: how to speculate (a SpecConfig, a method name, or None for the target alone).
    ``page_size``: KV tokens per page. ``kv_pool_tokens``: the KV pool's size (None: half the
    free GPU memory, 32768 on a CPU). ``max_batch_size``: requests run together.
    ``max_context``: tokens per request (None: the model's ``max_position_embeddings``).
    ``eos_token_ids``: extra end-of-sequence ids. ``validate``: the phase validation mode
    (``strict``, ``boundary``, ``off``; None: the process default). ``trace``: record phase
    transitions (on CPU tensor-parallel ranks with the all-reduces' time, docs/parallel.md).
    ``check_every_step``: check every invariant after each step. ``seed``: of the requests that
    set none. ``cuda_graphs``: True, False, ``"emulate"`` (the padding and
    slicing on the CPU, for tests) or None (on a GPU). ``graph_buckets``: the batch sizes graphs
    are captured for. ``graph_scope``: ``"iteration"`` (one graph per speculative iteration) or
    ``"phase"``. ``prefill_graphs``: graphs of prefill too. ``simulate_accept_length``:
    benchmark mode, every verify accepts this many tokens whatever they are. ``overlap``: the
    overlap scheduler (None: on a GPU). ``num_threads``: torch's threads for an engine on the
    CPU, set process-wide when the engine is built: 1 by default, the fastest on a busy machine
    (a decode step's small products gain little from more threads, and waiting threads lose
    their core to any other load); None leaves torch's setting alone. Ignored on a GPU.
    ``tensor_parallel_size``: ranks the target is split over (``Engine.from_pretrained`` starts
    the others itself, or joins a ``torchrun`` group; docs/parallel.md). ``tp_timeout_s``: how
    long a rank waits in a collective before :class:`WorkerDied`. ``tp_check``: all-reduce a
    checksum of the emitted tokens and of adaptive speculation's plan after every step (and of
    its cost table at start-up), :class:`RankDivergence` where ranks differ.
    ``draft_tensor_parallel_size``: 1 (the draft replicated on every rank, the default) or
    ``tensor_parallel_size`` (a standalone or EAGLE-3 draft split the target's way; the other
    kinds run transformers' modules, which are not split).
    ``tp_all_reduce``: ``"nccl"``, or ``"symm_mem"`` (GPUs: messages up to 8 MiB through torch's
    symmetric memory, one-shot over NVLink; larger ones through NCCL). ``tp_reduce_dtype``: what
    a half-precision target's row-parallel partial sums are all-reduced in: ``"float32"`` (the
    default: each layer's output is rounded once, after the sum, as on one GPU, so TP=N's
    tokens follow TP=1's) or ``"model"`` (half the bytes on the wire, a second rounding).
    ``prefix_cache``: share the KV of common prompt prefixes between requests (a radix tree
    over KV pages, ``runtime/prefix_cache.py``); off by default, so that a request's output
    never depends on the requests served before it (``docs/serving.md`` says why;
    ``phasegraph serve`` turns it on).
    ``spec_costs``: with adaptive speculation, the seconds per iteration of each shape by batch
    size (a :class:`~phasegraph.runtime.adaptive.CostTable`, whose shapes are then the ones
    the engine adapts over); None: measured at start-up.
    """

    spec: SpecConfig = attrs.field(default=None, converter=as_spec)
    page_size: int = attrs.field(default=1, validator=_count(MAX_PAGE_SIZE))
    kv_pool_tokens: int | None = attrs.field(default=None, validator=_count(MAX_KV_TOKENS, "sized from free memory"))
    max_batch_size: int = attrs.field(default=32, validator=_count(MAX_BATCH_SIZE))
    max_context: int | None = attrs.field(
        default=None, validator=_count(MAX_KV_TOKENS, "the model's max_position_embeddings"))
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    validate: str | None = None
    trace: bool = attrs.field(default=True, validator=_switch())
    check_every_step: bool = attrs.field(default=False, validator=_switch())
    seed: int = 0
    cuda_graphs: bool | str | None = attrs.field(default=None, validator=_switch(None, "emulate"))
    graph_buckets: tuple[int, ...] | None = None
    graph_scope: str = "iteration"
    prefill_graphs: bool = attrs.field(default=False, validator=_switch())
    simulate_accept_length: int | None = None
    overlap: bool | None = attrs.field(default=None, validator=_switch(None))
    num_threads: int | None = attrs.field(default=1, validator=_count(1024, "torch's own setting"))
    tensor_parallel_size: int = attrs.field(default=1, validator=_count(64))
    draft_tensor_parallel_size: int = attrs.field(default=1, validator=_count(64))
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S
    tp_check: bool = attrs.field(default=False, validator=_switch())
    tp_all_reduce: str = "nccl"
    tp_reduce_dtype: str = "float32"
    prefix_cache: bool = attrs.field(default=False, validator=_switch())
    spec_costs: CostTable | None = None

    def _check_draft_tensor_parallel(self) -> None:
        size = self.draft_tensor_parallel_size
        if size == 1:
            return
        if size != self.tensor_parallel_size:
            raise InvalidConfig(f"draft_tensor_parallel_size must be 1 (the draft replicated) or "
                                f"tensor_parallel_size={self.tensor_parallel_size}; got {size}")
        if self.spec.method not in DRAFT_TP_METHODS:
            raise InvalidConfig(f"draft_tensor_parallel_size={size} splits standalone and EAGLE-3 drafts only; method "
                                f"{self.spec.method!r} has no draft split over ranks: use draft_tensor_parallel_size=1")

    def __attrs_post_init__(self) -> None:
        if self.validate is not None:
            from phasegraph.statemachine.modes import ValidationMode

            try:
                ValidationMode.parse(self.validate)
            except ValueError as exc:
                raise InvalidConfig(f"validate: {exc}") from None
        if isinstance(self.tp_timeout_s, bool) or not isinstance(self.tp_timeout_s, (int, float)) \
                or not self.tp_timeout_s > 0:
            raise InvalidConfig(f"tp_timeout_s must be a positive number of seconds; got {self.tp_timeout_s!r}")
        self._check_draft_tensor_parallel()
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise InvalidConfig(f"tp_all_reduce must be one of {', '.join(TP_ALL_REDUCES)}; got {self.tp_all_reduce!r}")
        if self.tp_reduce_dtype not in TP_REDUCE_DTYPES:
            raise InvalidConfig(f"tp_reduce_dtype must be one of {', '.join(TP_REDUCE_DTYPES)}; got "
                                f"{self.tp_reduce_dtype!r}")
        if not is_int(self.seed):
            raise InvalidConfig(f"seed must be an integer; got {self.seed!r}")
        buckets = self.graph_buckets
        if buckets is not None:
            if (isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets
                    or any(not is_int(b) or b < 1 for b in buckets)):
                raise InvalidConfig(f"graph_buckets must be a list of batch sizes >= 1 (or None); got {buckets!r}")
            object.__setattr__(self, "graph_buckets", tuple(buckets))
        if self.graph_scope not in GRAPH_SCOPES:
            raise InvalidConfig(f"graph_scope must be one of {', '.join(GRAPH_SCOPES)}; got {self.graph_scope!r}")
        if self.spec_costs is not None and not isinstance(self.spec_costs, CostTable):
            raise InvalidConfig(f"spec_costs must be a CostTable or None; got {type(self.spec_costs).__name__}")
        accept = self.simulate_accept_length
        if accept is not None:
            tree = self.spec.tree()
            if not is_int(accept):
                raise InvalidConfig(f"simulate_accept_length must be an integer; got {accept!r}")
            if tree is None or not 1 <= accept <= tree.accept_width:
                raise InvalidConfig(
                    f"simulate_accept_length must be in [1, num_steps + 1] with a speculative method; "
                    f"got {accept!r}"
                )


@attrs.define
class RequestStats:
    """What happened to one request: accept lengths per verify step and time per phase."""

    accept_lengths: list[int] = attrs.field(factory=list)  # accepted drafts + 1, one per verify
    phase_time_s: dict[str, float] = attrs.field(factory=dict)  # wall time of the batches it was in
    retractions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled (every prefill)
    nonfinite_drafts: int = 0  # verify steps whose draft logits were NaN or infinite (their drafts rejected)

    @property
    def mean_accept_length(self) -> float | None:
        """τ for this request (None without speculation)."""
        if not self.accept_lengths:
            return None
        return sum(self.accept_lengths) / len(self.accept_lengths)


@attrs.define
class RequestOutput:
    """The result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" | None while running
    logprobs: list[float] | None = None  # of each generated token (SamplingParams.logprobs)
    stats: RequestStats = attrs.field(factory=RequestStats)
    error: str | None = None  # what went wrong, with finish_reason "error"
    # per generated position, the k most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # per prompt token: its logprob given the tokens before it (None for the first)
    prompt_logprobs: list[float | None] | None = None
    # per prompt token: the k most likely (token id, logprob) at its position (None for the first)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # per generated token, the expert ids each MoE layer chose ([num_moe_layers][k]), where asked
    routed_experts: list[list[list[int]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class RequestDelta:
    """New output of one request since the previous ``Engine.step()``."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: str | None
    error: str | None = None  # what went wrong, with finish_reason "error"
    accept_lengths: tuple[int, ...] = ()  # of the verify steps since the previous step()
    logprobs: tuple[float, ...] | None = None  # of new_token_ids, where the request asked for them
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None  # per new token, where asked
    # per new token, the expert ids each MoE layer chose, where asked (SamplingParams.return_routed_experts)
    routed_experts: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    # the whole result (statistics included) on the request's last delta, which carries the
    # finish reason: the engine forgets a request once it has reported it finished
    output: RequestOutput | None = None
