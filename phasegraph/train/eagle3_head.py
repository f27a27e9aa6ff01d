"""The EAGLE-3 draft head: module, training-time-test (TTT) attention, checkpoint layout.

Inference math (the runtime implements the same; names match the checkpoint keys)
----------------------------------------------------------------------------------
Target with ``L`` layers; ``aux = (2, L//2, L-3)`` clamped to ``[0, L-1]``; ``f_p`` is the concat
of the target's residual-stream inputs to those layers at position ``p`` (transformers'
``output_hidden_states`` entries ``hidden_states[i]``), width ``3*Ht``.

Draft row ``p`` has input token ``t_{p+1}`` and predicts ``t_{p+2}``::

    e    = target.embed_tokens(t_{p+1})                # the target's embedding (not in the head)
    h    = fc(f_p)                                     # step 0; steps j >= 1: h = previous `out`
    x    = concat(input_layernorm(e), hidden_norm(h))  # [2*Hd]
    q,k,v = q_proj(x), k_proj(x), v_proj(x)            # heads*D each; RoPE (HF Llama rotate_half
                                                       # convention, the target's rope_theta) at
                                                       # position p; causal over the draft's rows
    h1   = h + o_proj(attention(q, k, v))
    out  = h1 + down_proj(silu(gate_proj(n)) * up_proj(n)),  n = post_attention_layernorm(h1)
    logits = lm_head(norm(out))                        # [draft_vocab]; target id = d + d2t[d]

All RMSNorms compute in fp32 and cast back (as ``LlamaRMSNorm``); attention scale ``D**-0.5``;
grouped KV heads are shared by consecutive query heads (as transformers' ``repeat_kv``).

Chain drafting from base row ``b`` (the last row the target has features for): step 0 is row
``b`` itself; draft step ``j >= 1`` runs at position ``b+j`` with token = the token step ``j-1``
predicted and ``h`` = step ``j-1``'s ``out``, and attends the step-0 keys of rows ``<= b`` plus
the keys of draft steps ``1..j`` of its own chain (its ancestors and itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

__all__ = [
    "Eagle3Config",
    "Eagle3Head",
    "apply_rope",
    "eagle3_aux_layers",
    "load_eagle3_head",
    "rope_cos_sin",
    "save_eagle3_head",
    "shift_rows",
    "ttt_attention",
    "ttt_attention_mask",
    "ttt_attention_reference",
]


def eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose residual inputs form the EAGLE-3 features: ``(2, L//2, L-3)`` clamped."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # Hd (= Ht)
    target_hidden_size: int  # Ht
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    eagle_aux_layers: tuple[int, int, int]
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1024
    eos_token_id: int = 0

    def to_json_dict(self, dtype: str = "bfloat16") -> dict:
        """``config.json``: Llama keys plus the EAGLE-3 ones."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_layers": list(self.eagle_aux_layers),
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": self.eos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.eos_token_id,
            "torch_dtype": dtype,
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> Eagle3Config:
        theta = d.get("rope_theta") or d.get("rope_parameters", {}).get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim", d["hidden_size"] // heads),
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size", d["vocab_size"]),
            eagle_aux_layers=tuple(d["eagle_aux_layers"]),
            rope_theta=float(theta),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            max_position_embeddings=d.get("max_position_embeddings", 1024),
            eos_token_id=d.get("eos_token_id", 0),
        )


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama rotary tables in fp32, shape ``positions.shape + (head_dim,)``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                  / head_dim)
    )
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, D]``, ``cos/sin [B or 1, T, D]``; rotate_half convention."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def shift_rows(x: torch.Tensor, shift: int, dim: int = -2) -> torch.Tensor:
    """``y[..., r, :] = x[..., r - shift, :]`` along ``dim``, zeros where ``r < shift``."""
    if shift == 0:
        return x
    dim = dim % x.ndim
    n = x.shape[dim]
    pad_shape = list(x.shape)
    pad_shape[dim] = min(shift, n)
    head = x.new_zeros(pad_shape)
    return torch.cat([head, x.narrow(dim, 0, n - pad_shape[dim])], dim=dim)


# ---------------------------------------------------------------------------------------------
# Training-time test attention
# ---------------------------------------------------------------------------------------------


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Which keys the queries of unroll step ``j = step`` attend, as a bool ``[T, (j+1)*T]``.

    Keys are laid out block by block: block ``i`` (columns ``i*T .. i*T+T-1``) holds the keys
    that unroll step ``i`` computed at rows ``0..T-1``. Row ``p`` of step ``j`` stands for draft
    step ``j`` of a chain whose base (the last teacher-forced row) is ``b = p - j``, i.e. the
    query at position ``p`` of a chain ``b -> b+1 -> ... -> p``. At inference it sees:

    - the step-0 (teacher-forced, draft-extend) keys of rows ``0..b = p-j``: block 0 is a causal
      mask shifted ``j`` rows down (``tril(-j)``);
    - the keys its own ancestors wrote at draft steps ``1..j-1`` and its own key: the step-``i``
      key of that chain sits at row ``b + i = p - (j - i)``, so block ``i`` is the identity
      shifted ``j - i`` rows down (block ``j`` is the plain diagonal: the query itself).

    Rows ``p < j`` have no base (``b < 0``): block 0 and the blocks whose diagonal falls before
    row 0 are empty there, the self key (block ``j``) never is, so no row is fully masked. Those
    rows are excluded from the loss.

    Example ``T = 4, j = 2`` (``x`` attended)::

        p | block 0 (step 0) | block 1 (step 1) | block 2 (step 2)
        0 | . . . .          | . . . .          | x . . .
        1 | . . . .          | x . . .          | . x . .
        2 | x . . .          | . x . .          | . . x .
        3 | x x . .          | . . x .          | . . . x
    """
    t, j = seq_len, step
    mask = torch.zeros(t, (j + 1) * t, dtype=torch.bool, device=device)
    mask[:, :t] = torch.ones(t, t, dtype=torch.bool, device=device).tril(-j)
    for i in range(1, j + 1):
        shift = j - i
        mask[:, i * t : (i + 1) * t] = torch.ones(t, t, dtype=torch.bool, device=device).tril(
            -shift
        ) & ~torch.ones(t, t, dtype=torch.bool, device=device).tril(-shift - 1)
    return mask


def ttt_attention_reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Dense form of :func:`ttt_attention`: one softmax over all ``(j+1)*T`` keys under
    :func:`ttt_attention_mask`. ``q, keys[i], values[i]: [B, heads, T, D]``. For tests."""
    step = len(keys) - 1
    mask = ttt_attention_mask(q.shape[-2], step, q.device)
    k = torch.cat(keys, dim=-2).float()
    v = torch.cat(values, dim=-2).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Attention of unroll step ``j = len(keys) - 1`` under :func:`ttt_attention_mask`, without
    materialising the diagonal blocks: block 0 is a ``[T, T]`` score matrix, each block ``i >= 1``
    contributes one score per row (a row-wise dot product with the shifted keys).

    ``q, keys[i], values[i]: [B, heads, T, D]`` (KV heads already expanded). Returns ``q``'s shape.
    """
    step = len(keys) - 1
    t = q.shape[-2]
    rows = torch.arange(t, device=q.device)
    s0 = (q @ keys[0].transpose(-1, -2)).float() * scale
    block0 = rows[None, :] <= rows[:, None] - step  # key row r <= p - j
    parts = [s0.masked_fill(~block0, float("-inf"))]
    for i in range(1, step + 1):
        shift = step - i
        k_i = shift_rows(keys[i], shift)
        d = (q.float() * k_i.float()).sum(-1) * scale
        parts.append(d.masked_fill(rows < shift, float("-inf"))[..., None])
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = probs[..., :t].to(values[0].dtype) @ values[0]
    out = out.float()
    for i in range(1, step + 1):
        v_i = shift_rows(values[i], step - i).float()
        out = out + probs[..., t + i - 1, None] * v_i
    return out.to(q.dtype)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B,H,Q,D]``, ``k/v [B,H,S,D]``, ``mask [B,Q,S]`` bool (every row has a true entry)."""
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1).to(v.dtype) @ v).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


class Eagle3Head(nn.Module):
    """EAGLE-3 head; parameter names are the checkpoint keys (``fc.weight``, ``midlayer.*``,
    ``norm.weight``, ``lm_head.weight``; buffers ``d2t``/``t2d`` when the draft vocabulary is
    smaller than the target's)."""

    def __init__(self, cfg: Eagle3Config, draft_to_target: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        if cfg.draft_vocab_size < cfg.vocab_size:
            ids = (
                draft_to_target
                if draft_to_target is not None
                else torch.arange(cfg.draft_vocab_size)
            ).to(torch.int64)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            self.register_buffer("d2t", ids - torch.arange(cfg.draft_vocab_size))
            self.register_buffer("t2d", t2d)
        else:
            self.d2t = None
            self.t2d = None

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    # -- pieces ---------------------------------------------------------------------------------

    def target_ids(self) -> torch.Tensor | None:
        """Target id of each draft id, or None for the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        return kv if self.n_rep == 1 else kv.repeat_interleave(self.n_rep, dim=1)

    def qkv(
        self, hidden: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden, emb [B, T, Hd]`` -> q ``[B, heads, T, D]``, k/v ``[B, kv_heads, T, D]``."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = m.self_attn.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``attn [B, heads, T, D]`` -> ``out [B, T, Hd]`` (residual, MLP)."""
        m = self.midlayer
        b, _, t, _ = attn.shape
        h1 = hidden + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return h1 + m.mlp(m.post_attention_layernorm(h1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            positions = positions[None]
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

    # -- whole passes -----------------------------------------------------------------------------

    def ttt_forward(
        self,
        features: torch.Tensor,
        emb: torch.Tensor,
        unroll: int,
        emb_later: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test over rows ``0..T-1`` (RoPE position = row), ``unroll`` steps.

        ``features [B, T, 3Ht]`` (``f_p``), ``emb [B, T, Hd]`` (embedding of ``t_{p+1}``);
        ``emb_later`` replaces ``emb`` at steps ``j >= 1`` if given. Step 0 is the teacher-forced
        pass (``h = fc(f)``, causal); at step ``j >= 1`` row ``p`` takes ``h = out_{j-1}[p-1]``
        and attends per :func:`ttt_attention_mask`. Returns ``out`` of every step
        ``[B, T, Hd]``; row ``p`` of step ``j`` is meaningful for ``p >= j`` only.
        """
        t = emb.shape[1]
        cos, sin = self._rope(torch.arange(t, device=emb.device))
        hidden = self.fc(features)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for j in range(unroll):
            if j > 0:
                hidden = shift_rows(outs[-1], 1, dim=1)
                if emb_later is not None:
                    emb = emb_later
            q, k, v = self.qkv(hidden, emb, cos, sin)
            keys.append(self._expand(k))
            values.append(self._expand(v))
            outs.append(self.finish(hidden, ttt_attention(q, keys, values, self.scale)))
        return outs

    def extend(
        self, features: torch.Tensor, emb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forced causal pass (draft-extend): ``out [B,T,Hd]``, ``k, v [B,kv_heads,T,D]``."""
        t = emb.shape[1]
        cos, sin = self._rope(torch.arange(t, device=emb.device))
        hidden = self.fc(features)
        q, k, v = self.qkv(hidden, emb, cos, sin)
        attn = ttt_attention(q, [self._expand(k)], [self._expand(v)], self.scale)
        return self.finish(hidden, attn), k, v

    def step(
        self,
        hidden: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft step for ``Q`` queries per sequence.

        ``hidden, emb [B, Q, Hd]``, ``positions [B, Q]``, context keys/values
        ``[B, kv_heads, S, D]`` with ``ctx_mask [B, Q, S]`` (prefix rows and ancestors each query
        may see); every query also attends its own new key. Returns ``out [B, Q, Hd]`` and the
        new ``k, v [B, kv_heads, Q, D]``.
        """
        cos, sin = self._rope(positions)
        q, k, v = self.qkv(hidden, emb, cos, sin)
        n_q = q.shape[2]
        self_mask = torch.eye(n_q, dtype=torch.bool, device=q.device).expand(q.shape[0], -1, -1)
        keys = self._expand(torch.cat([ctx_k, k], dim=2))
        vals = self._expand(torch.cat([ctx_v, v], dim=2))
        mask = torch.cat([ctx_mask, self_mask], dim=-1)
        attn = _masked_attention(q, keys, vals, mask, self.scale)
        return self.finish(hidden, attn), k, v


# ---------------------------------------------------------------------------------------------
# Checkpoint layout
# ---------------------------------------------------------------------------------------------


def save_eagle3_head(head: Eagle3Head, out_dir: Path, dtype: torch.dtype) -> None:
    """``config.json`` + ``model.safetensors`` (float tensors in ``dtype``; ``d2t`` int64 and
    ``t2d`` bool when present)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in head.state_dict().items():
        value = value.detach().to("cpu")
        tensors[name] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    config = head.cfg.to_json_dict(dtype_name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_eagle3_head(
    path: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Eagle3Head:
    """Load a head saved by :func:`save_eagle3_head` (strict: every key must be present)."""
    path = Path(path)
    cfg = Eagle3Config.from_json_dict(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    ids = None
    if "d2t" in tensors:
        ids = torch.arange(cfg.draft_vocab_size) + tensors["d2t"]
    head = Eagle3Head(cfg, draft_to_target=ids)
    head.load_state_dict(tensors, strict=True)
    if dtype is not None:
        head.to(dtype)
    return head.to(device).eval()
