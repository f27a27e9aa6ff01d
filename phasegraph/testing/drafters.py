"""Hand-made drafters for tests: they know the target's greedy continuation of every request.

They satisfy the ``DraftModel`` protocol and identify requests through the engine that runs
them (page-table rows during draft-extend, batch rows during draft steps; set ``draft.engine``
after building the engine), and look up each request's continuation by its prompt. So they
exercise the real phases, kernels and scheduler:

- :class:`OracleDraft` proposes the target's own greedy continuation: every draft is accepted
  where the tree allows it (acceptance S+1 with a chain); :class:`HiddenChainOracleDraft` does
  so only where each draft step received the hidden state the row before it produced;
- :class:`AdversaryDraft` never proposes the right token (acceptance 1: the bonus only);
- :class:`RandomDraft` proposes pseudo-random tokens;
- :class:`NoisyOracleDraft` ranks the right token anywhere among its top-k or outside it, by a
  deterministic hash, so acceptance stops at every depth and on every branch.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.random import counter_uniform
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.config import is_int
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.runtime.kv_pool import KVSpec


class _ScriptedDraft(abc.ABC):
    uses_features = False
    hidden_size = 0
    kv_lead = 0

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], vocab_size: int):
        name = type(self).__name__
        if not isinstance(continuations, Mapping):
            raise InvalidConfig(f"{name}: continuations must map each prompt (a sequence of token "
                                f"ids) to its greedy continuation, got {type(continuations).__name__}")
        if not is_int(vocab_size) or vocab_size < 2:
            raise InvalidConfig(f"{name}: vocab_size must be an integer >= 2, got {vocab_size!r}")
        self.engine = None  # set once the engine that runs this draft exists
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.vocab_size = vocab_size
        # A one-number KV per slot: the draft phase still copies branch regions through it.
        self.kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.pool = None
        self.calls = 0

    def attach_kv(self, pool) -> None:
        self.pool = pool

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    @property
    def _width(self) -> int:
        """Candidates a row ranks: the most any shape of the engine keeps."""
        ctx = self.engine.ctx
        return max(ctx.draft_topk or ctx.tree.topk, 1)

    def _owner_of_page_row(self, row: int):
        if row == 0:
            return None  # the reserved padding row
        sched = self.engine.scheduler
        for req in (*sched.issuing, *sched.running):  # those being prefilled, then the batch
            if req.row == row:
                return req
        raise LookupError(f"no request holds page-table row {row}")

    @staticmethod
    def _batch_row(running, index: int):
        return running[index] if index < len(running) else None

    def _token_at(self, req, i: int) -> int:
        """Token ``i`` of the request's prompt plus the target's greedy continuation (0 past it)."""
        continuation = self.continuations.get(tuple(req.prompt))
        if continuation is None:
            raise InvalidConfig(
                f"{type(self).__name__} has no continuation for the prompt of request "
                f"{req.request_id!r} ({len(req.prompt)} tokens): give it every prompt the engine runs"
            )
        seq = req.prompt + continuation
        return seq[i] if i < len(seq) else 0

    def _true_next(self, req, draft_position: int) -> int:
        """The token the target's greedy decoding puts at ``draft_position + 2``: a draft row at
        position p carries token p+1 and predicts token p+2."""
        return self._token_at(req, draft_position + 2)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int,
        logits_index: torch.Tensor | None = None,
    ) -> DraftOutput:
        if self.engine is None:
            raise InvalidConfig(f"{type(self).__name__}.engine is not set: assign draft.engine = "
                                "engine once the engine that runs it is built")
        self.calls += 1
        rows = list(range(input_ids.shape[0])) if logits_index is None else logits_index.tolist()
        pos = positions.tolist()
        qrow = attn.query_row.tolist()
        sched = self.engine.scheduler
        running = sched.issuing or sched.running  # the rows the phases now run (a group, where split)
        K = self.engine.ctx.tree.topk  # beams of this iteration's shape
        # CUDA-graph padding rows (page-table row 0, batch rows past the running batch) belong
        # to no request: they get token 0 as their "right" token.
        reqs = [
            self._owner_of_page_row(qrow[r]) if from_target else self._batch_row(running, qrow[r] // K)
            for r in rows
        ]
        p = torch.tensor([pos[r] for r in rows], dtype=torch.int64)
        true = torch.tensor(
            [0 if q is None else self._true_next(q, pos[r]) for q, r in zip(reqs, rows, strict=True)],
            dtype=torch.int64,
        )
        keys = torch.tensor([0 if q is None else hash(q.request_id) & 0x7FFFFFFF for q in reqs], dtype=torch.int64)
        logits = self.score(keys, p, true)  # [R, V]
        if not from_target:
            logits = self._draft_step_logits(logits, input_ids, hidden, rows, reqs, keys, p, true)
        return DraftOutput(logits=logits.to(input_ids.device), hidden=self._hidden_out(input_ids, positions))

    def _draft_step_logits(self, logits, input_ids, hidden, rows, reqs, keys, positions, true_tokens):
        """The logits of draft-step rows (``from_target=False``), given their input tokens and
        the hidden rows they got."""
        return logits

    def _hidden_out(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 0, device=input_ids.device)

    __call__ = forward

    @abc.abstractmethod
    def score(self, keys: torch.Tensor, positions: torch.Tensor, true_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] for draft rows (request key, position) whose right token is known."""

    def _ranked(self, ranking: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] whose softmax ranks ``ranking`` [R, k] first, in column order, and gives
        every other token a probability far below them."""
        R, k = ranking.shape
        logits = torch.full((R, self.vocab_size), -30.0)
        values = 10.0 - torch.arange(k, dtype=torch.float32).expand(R, k)
        return logits.scatter(1, ranking, values)

    def _others(self, keys, positions, true_tokens, count: int) -> torch.Tensor:
        """``count`` distinct tokens per row, none of them the true one, varying with the row."""
        span = self.vocab_size - count - 1
        shift = (counter_uniform(keys, positions * 4 + 1) * span).long()  # [R]
        j = torch.arange(count)
        return (true_tokens[:, None] + 1 + shift[:, None] + j) % self.vocab_size


class OracleDraft(_ScriptedDraft):
    """Proposes the target's greedy continuation first, then arbitrary other tokens."""

    def score(self, keys, positions, true_tokens):
        k = self._width
        others = self._others(keys, positions, true_tokens, k - 1)
        return self._ranked(torch.cat([true_tokens[:, None], others], dim=1))


class HiddenChainOracleDraft(OracleDraft):
    """An :class:`OracleDraft` whose draft steps need the hidden state of the row before them.

    Every row outputs the hidden state ``[position + 1, its input token]``. A draft-step row at
    position p proposes the right token only if it carries the right token and the hidden state
    it received is ``[p, the token at p in the true sequence]``: what the previous row of the
    right path, in draft-extend or in the step before, produced. Any other row gives the right
    token probability 0 and spreads the rest evenly, so wrong paths fade and the right path
    keeps a beam. With ``second_rate`` > 0 a
    fitting row ranks the right token second (10 against 9.9) at that rate, so that the right
    path changes beam slots and its hidden state must move with it. A phase that feeds a step a
    stale hidden state (SGLang #22041: chained MTP steps reusing step 0's) or moves it with the wrong
    beam loses the right token there, and acceptance drops below the oracle's.
    """

    uses_features = True  # draft-extend keeps the hidden state of every request's last row
    hidden_size = 2

    def __init__(self, *args, second_rate: float = 0.0, **kw):
        super().__init__(*args, **kw)
        ok = isinstance(second_rate, (int, float)) and not isinstance(second_rate, bool)
        if not (ok and 0.0 <= second_rate <= 1.0):  # NaN fails the comparison too
            raise InvalidConfig(f"HiddenChainOracleDraft: second_rate must be a number in [0, 1], "
                                f"got {second_rate!r}")
        self.second_rate = second_rate

    def _hidden_out(self, input_ids, positions):
        return torch.stack([positions + 1, input_ids], dim=1).to(torch.float32)  # [T, 2]

    def _draft_step_logits(self, logits, input_ids, hidden, rows, reqs, keys, positions, true_tokens):
        owned = torch.tensor([q is not None for q in reqs])
        # per row at position p: the hidden state it needs, [p, token p], and the token it must
        # carry, p + 1 (padding rows: anything)
        want = torch.tensor([[p, 0, 0] if q is None else [p, self._token_at(q, p), self._token_at(q, p + 1)]
                             for q, p in zip(reqs, positions.tolist(), strict=True)])  # [R, 3]
        got = hidden[rows].to(torch.int64).cpu() if hidden is not None else torch.full_like(want[:, :2], -1)
        on_path = input_ids[rows].cpu() == want[:, 2]  # [R]
        fits = ((got == want[:, :2]).all(dim=1) & on_path) | ~owned  # [R]
        other = self._others(keys, positions, true_tokens, 1)  # [R, 1]
        second = torch.full((len(rows), self.vocab_size), -30.0).scatter(1, other, 10.0)
        second = second.scatter(1, true_tokens[:, None], 9.9)
        swap = counter_uniform(keys, positions * 4 + 5) < self.second_rate
        logits = torch.where((fits & swap)[:, None], second, logits)
        faded = torch.zeros(len(rows), self.vocab_size).scatter(1, true_tokens[:, None], float("-inf"))
        return torch.where(fits[:, None], logits, faded)


class AdversaryDraft(_ScriptedDraft):
    """Ranks K tokens first, none of them the right one; the right token gets probability 0."""

    def score(self, keys, positions, true_tokens):
        k = self._width
        logits = self._ranked(self._others(keys, positions, true_tokens, k))
        return logits.scatter(1, true_tokens[:, None], float("-inf"))


class RandomDraft(_ScriptedDraft):
    """Ranks K pseudo-random tokens (a function of request and position); right only by chance."""

    def score(self, keys, positions, true_tokens):
        k = self._width
        start = (counter_uniform(keys, positions * 4 + 3) * self.vocab_size).long()  # [R]
        return self._ranked((start[:, None] + torch.arange(k)) % self.vocab_size)


class NoisyOracleDraft(_ScriptedDraft):
    """Puts the right token at a pseudo-random rank 0..K (rank K: not proposed at all), rank 0
    with probability ``accept_rate``."""

    def __init__(self, *args, accept_rate: float = 0.6, **kw):
        super().__init__(*args, **kw)
        ok = isinstance(accept_rate, (int, float)) and not isinstance(accept_rate, bool)
        if not (ok and 0.0 <= accept_rate <= 1.0):  # NaN fails the comparison too
            raise InvalidConfig(f"NoisyOracleDraft: accept_rate must be a number in [0, 1], got {accept_rate!r}")
        self.accept_rate = accept_rate

    def score(self, keys, positions, true_tokens):
        k = self._width
        u = counter_uniform(keys, positions * 4 + 2)  # [R]
        v = counter_uniform(keys, positions * 4 + 3)
        rank = torch.where(u < self.accept_rate, 0, 1 + (v * k).long().clamp(max=k - 1))
        if k == 1:
            rank = torch.where(u < self.accept_rate, 0, 1)
        others = self._others(keys, positions, true_tokens, k)  # [R, k]
        cols = torch.arange(k + 1)[None, :]  # slot c holds others[c - (c > rank)] or the true token
        idx = (cols - (cols > rank[:, None]).long()).clamp(max=k - 1)
        ranking = torch.where(cols == rank[:, None], true_tokens[:, None], others.gather(1, idx))
        logits = self._ranked(ranking[:, :k])
        # rank k: the true token is not among the k proposed; push it below all of them
        hidden_true = torch.where(rank >= k, -40.0, logits.gather(1, true_tokens[:, None])[:, 0])
        return logits.scatter(1, true_tokens[:, None], hidden_true[:, None])
