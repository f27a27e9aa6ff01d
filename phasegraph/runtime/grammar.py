"""Structured output: a request's JSON schema, regex or EBNF grammar, through xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", 2024) is imported lazily, so the engine runs without the ``grammar`` extra
until a request asks for a grammar.
"""

from __future__ import annotations

import json

import torch

from phasegraph.runtime.errors import InvalidRequest

# the kinds a request may give, at most one per request
GRAMMAR_KINDS = ("json_schema", "regex", "grammar")


class InvalidGrammar(InvalidRequest):
    """A request's JSON schema, regex or grammar does not compile. Nothing was queued."""


def canonical_json_schema(schema: object) -> str:
    """``schema`` (a dict, or its JSON text) as JSON text, so the params stay hashable."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidGrammar(f"json_schema must be a JSON object (a dict or its text); got {type(schema).__name__}")
    return json.dumps(schema, sort_keys=True)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest(
            "structured output (json_schema, regex, grammar) needs the grammar extra: pip install 'phasegraph[grammar]'"
        ) from None
    return xgrammar


def compile_grammar(kind: str, spec: str):
    """The tokenizer-free ``xgrammar.Grammar`` of ``spec``; a spec that does not parse raises
    ``InvalidGrammar`` naming the kind and the engine's reason."""
    xgr = _xgrammar()
    build = {
        # compact JSON (", " and ": ", no other whitespace): a grammar that allows any
        # whitespace lets a model loop on blanks until its budget ends, unparseable
        "json_schema": lambda s: xgr.Grammar.from_json_schema(s, any_whitespace=False),
        "regex": xgr.Grammar.from_regex,
        "grammar": lambda s: xgr.Grammar.from_ebnf(s, root_rule_name="root"),
    }[kind]
    try:
        return build(spec)
    except (RuntimeError, ValueError) as e:
        # xgrammar prefixes its C++ source location; the reason follows the last "] ... : "
        reason = str(e).strip().splitlines()[0].split("] ", 1)[-1]
        raise InvalidGrammar(f"{kind} does not compile: {reason}") from None


class GrammarCompiler:
    """An engine's grammar compiler: its tokenizer's vocabulary for xgrammar, and every grammar
    compiled so far, by (kind, spec). One matcher per request comes from it (:meth:`matcher`)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        if tokenizer is None:
            raise InvalidRequest("structured output needs the target's tokenizer (this engine has none)")
        if not stop_token_ids:
            raise InvalidRequest("structured output needs an end-of-sequence token id to end on "
                                 "(pass eos_token_ids=...)")
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._matcher_cls = xgr.GrammarMatcher
        self._compiled: dict[tuple[str, str], object] = {}

    def matcher(self, kind: str, spec: str):
        """A fresh ``xgrammar.GrammarMatcher`` of the request's grammar (compiled once per spec)."""
        compiled = self._compiled.get((kind, spec))
        if compiled is None:
            compiled = self._compiler.compile_grammar(compile_grammar(kind, spec))
            self._compiled[(kind, spec)] = compiled
        return self._matcher_cls(compiled)


class BatchGrammar:
    """The grammar masks of one batch's rows (:class:`~phasegraph.phases.protocols.GrammarMasks`),
    from each request's matcher (None: no grammar, every token allowed).

    Masks are filled on the host (xgrammar's matchers run there), walking each path with
    ``accept_token`` and undoing it with ``rollback``, so every matcher is left at the request's
    emitted tokens: only :meth:`Request.append` advances it, over the tokens a phase emitted.
    """

    def __init__(self, matchers: list, vocab_size: int, device, resumed: list[bool] | None = None):
        self.matchers = matchers
        # prefill of retracted requests: their first token is one the matcher already took
        self.resumed = resumed or [False] * len(matchers)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._beams: list[list[int]] = []  # the draft beams' paths, kept between beam_bitmask calls

    def _all_allowed(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.words), -1, dtype=torch.int32)  # [R, Vw] every bit set

    @staticmethod
    def _fill(matcher, out, row: int) -> None:
        if not matcher.is_terminated():  # a finished grammar: the row is never used
            matcher.fill_next_token_bitmask(out, row)

    def _masks(self, paths: list[list[int]], per_request: int = 1) -> torch.Tensor:
        """[len(paths), Vw]: row r after request r // per_request's emitted tokens plus
        ``paths[r]``; rows of padded requests (past the matchers) and rows whose path the
        grammar refuses allow every token."""
        out = self._all_allowed(len(paths))  # [R, Vw]
        for r, path in enumerate(paths):
            b = r // per_request
            m = self.matchers[b] if b < len(self.matchers) else None
            if m is None:
                continue
            taken = 0
            for token in path:
                if m.is_terminated() or not 0 <= token < self.vocab_size or not m.accept_token(token):
                    break  # ended, or a token no path may hold: no token may follow
                taken += 1
            if taken == len(path):
                self._fill(m, out, r)
            if taken:
                m.rollback(taken)
        return out.to(self.device)

    def next_token_bitmask(self, rows: int | None = None) -> torch.Tensor:
        return self._masks([[] for _ in range(len(self.matchers) if rows is None else rows)])

    def beam_bitmask(self, beam_tokens: torch.Tensor, beam_parent: torch.Tensor | None = None) -> torch.Tensor:
        B, K = beam_tokens.shape
        tokens = beam_tokens.tolist()  # [B, K] host round trip: the tokens are chosen on the device
        if beam_parent is None:
            self._beams = [[t] for row in tokens for t in row]
        else:
            parent = beam_parent.tolist()
            self._beams = [self._beams[b * K + parent[b][k]] + [tokens[b][k]] for b in range(B) for k in range(K)]
        return self._masks(self._beams, per_request=K)

    def next_token_bitmask_after(self, new_tokens: torch.Tensor) -> torch.Tensor:
        rows = new_tokens.tolist()  # [B, W] host round trip; -1 pads, negative marks
        resumed = self.resumed + [False] * (len(rows) - len(self.resumed))
        return self._masks([[t for t in row[int(res):] if t >= 0] for row, res in zip(rows, resumed, strict=True)])

    def tree_bitmask(self, draft_tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        B, N = parents.shape
        tokens = draft_tokens.view(B, N).tolist()  # host round trip: the tree's tokens
        par = parents.tolist()
        out = self._all_allowed(B * N)  # [B*N, Vw]
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            children: list[list[int]] = [[] for _ in range(N)]
            for j in range(1, N):
                children[par[b][j]].append(j)

            def visit(j: int, m=m, b=b, children=children) -> None:
                # node j's row: the tokens allowed after its path (depth-first: accept, recurse, undo)
                self._fill(m, out, b * N + j)
                if m.is_terminated():  # the path ended: its children are never reached
                    return
                for c in children[j]:
                    if 0 <= tokens[b][c] < self.vocab_size and m.accept_token(tokens[b][c]):
                        visit(c)
                        m.rollback(1)

            visit(0)  # the root is the bonus token, already emitted
        return out.to(self.device)
