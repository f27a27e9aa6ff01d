"""The target model as the phases see it: a transformers Llama-family causal LM over the pool.

:class:`HFTarget` implements :class:`phasegraph.phases.protocols.TargetModel`. It keeps
transformers' own modules (embedding, rotary embedding, decoder layers, final norm, lm_head) and
drives the decoder layers itself, one flattened batch ``[1, T]`` at a time, with the
``"phasegraph"`` attention implementation reading/writing the paged KV pool. Driving the layers
directly (instead of ``model(...)``) means no mask is ever built and the EAGLE-3 features are
simply the hidden states entering the chosen layers: no hooks, nothing that breaks CUDA-graph
capture.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.linear import linear
from phasegraph.phases.protocols import TargetOutput
from phasegraph.runtime.errors import DraftMismatch, UnsupportedModel
from phasegraph.runtime.kv_pool import KVPool, KVSpec, check_pool_fits
from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION, forward_context
from phasegraph.runtime.models.fused_decoder import (
    fuse_decoder,
    fuse_layer,
    layer_window,
    run_fused_decoder,
    shard_target,
    unfusable_reason,
    unsplittable,
)
from phasegraph.runtime.models.loading import (
    Checkpoint,
    check_model_parts,
    check_module_keys,
    config_errors,
    load_into_module,
    load_tensors,
    read_config,
)
from phasegraph.runtime.models.moe import (
    capture_experts,
    experts_implementation,
    experts_per_token,
    moe_routers,
    recording_routes,
)
from phasegraph.runtime.models.take_rows import take_rows

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
FEATURE_MODES = ("last", "eagle3", "none")


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Layers whose residual input EAGLE-3 fuses: (2, L//2, L-3) clamped to [0, L-1]."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def declared_eagle3_layers(raw: dict, num_layers: int, where: str) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head's ``config.json`` says it was trained on, as indices of
    the layers whose residual input is captured; None where it declares none (the default
    :func:`eagle3_feature_layers` then holds).

    Two spellings: ``eagle_aux_layers`` (phasegraph's trainer: the captured layers themselves)
    and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge / SGLang: layers whose
    *output* is captured, i.e. the input of the layer after). A head that declares both must
    mean the same layers."""
    declared: dict[str, tuple[int, ...]] = {}
    if raw.get("eagle_aux_layers") is not None:
        declared["eagle_aux_layers"] = _three_layer_ids(raw["eagle_aux_layers"], "eagle_aux_layers", where)
    eagle_config = raw.get("eagle_config")
    if isinstance(eagle_config, dict) and eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
        name = "eagle_config.eagle_aux_hidden_state_layer_ids"
        outputs_of = _three_layer_ids(eagle_config["eagle_aux_hidden_state_layer_ids"], name, where)
        declared[name] = tuple(i + 1 for i in outputs_of)
    if not declared:
        return None
    if len(set(declared.values())) > 1:
        raise DraftMismatch(f"{where}: the head declares two different sets of target layers: " + "; ".join(
            f"{name} captures the inputs of layers {list(layers)}" for name, layers in declared.items()))
    name, layers = next(iter(declared.items()))
    if not all(0 <= i < num_layers for i in layers):
        raise DraftMismatch(
            f"{where}: {name} asks for the inputs of target layers {list(layers)}, but the target "
            f"has layers 0..{num_layers - 1}"
        )
    return layers


def _three_layer_ids(value, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise DraftMismatch(f"{where}: {name} must list three target layer indices; got {value!r}")
    return tuple(value)


def check_model_type(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


@contextlib.contextmanager
def no_weight_init():
    """Skip random initialisation while building a model whose weights are loaded next."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_causal_lm(
    config, dtype: torch.dtype, device: torch.device | str, *, init: bool
) -> PreTrainedModel:
    """A ``*ForCausalLM`` for (a copy of) ``config`` on ``device`` in ``dtype``, phasegraph attention."""
    config = copy.deepcopy(config)
    ctx = contextlib.nullcontext() if init else no_weight_init()
    with torch.device(device), ctx:
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
    model.tie_weights()
    return model.eval()


def load_causal_lm(
    directory: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    *,
    allow_bin: bool = False,
    progress: bool = False,
) -> PreTrainedModel:
    """Build a supported causal LM from ``directory`` and load its weights strictly
    (``progress``: a bar over the tensors)."""
    checkpoint, config = _open_causal_lm(directory, allow_bin)
    model = build_causal_lm(config, resolve_dtype(dtype), device, init=False)
    load_into_module(model, checkpoint, progress=progress)
    return model


def _open_causal_lm(directory: str | Path, allow_bin: bool = False):
    """(checkpoint, config) of a supported causal LM, file and config errors raised first."""
    directory = Path(directory)
    raw = read_config(directory)
    check_model_type(raw.get("model_type"), str(directory))
    checkpoint = Checkpoint(directory, allow_bin=allow_bin)  # file errors before building
    with config_errors(directory):
        config = AutoConfig.from_pretrained(str(directory))
    check_model_parts(config, directory)
    return checkpoint, config


def load_split_causal_lm(
    directory: str | Path, dtype: torch.dtype | str, device: torch.device
) -> tuple[PreTrainedModel, Checkpoint]:
    """:func:`load_causal_lm` for a rank about to keep a slice of each decoder layer: every key
    checked as there, the tensors outside the layers loaded on ``device``, the layers left on
    the meta device (no memory) for :func:`read_layer`, so no rank holds the whole model."""
    checkpoint, config = _open_causal_lm(directory)
    model = build_causal_lm(config, resolve_dtype(dtype), "meta", init=False)
    check_module_keys(model, checkpoint)
    reason = unfusable_reason(model)
    if reason is not None:
        raise unsplittable("target", reason)
    inner = model.model
    layers, inner.layers = inner.layers, torch.nn.ModuleList()
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave each tied name a tensor of its own
    with torch.device(device):  # its tables, computed (to_empty left them garbage)
        inner.rotary_emb = type(inner.rotary_emb)(config=model.config)
    load_tensors(model, checkpoint)
    inner.layers = layers
    return model, checkpoint


def read_layer(model: PreTrainedModel, checkpoint: Checkpoint, index: int) -> torch.nn.Module:
    """Decoder layer ``index`` of a :func:`load_split_causal_lm` model, read into a host copy
    (the model's own stays on the meta device)."""
    layer = copy.deepcopy(model.model.layers[index]).to_empty(device="cpu")
    computed = [name for name, _ in layer.named_buffers() if name not in layer.state_dict()]
    if computed:  # to_empty left them garbage, and no checkpoint holds them
        raise UnsupportedModel(f"decoder layer {index} computes buffers of its own ({', '.join(computed)}); "
                               "it cannot be read one layer at a time for tensor parallelism")
    load_tensors(layer, checkpoint, prefix=f"model.layers.{index}.")
    return layer


class HFTarget:
    """:class:`TargetModel` over a transformers Llama/Qwen2/Qwen3/Mistral causal LM.

    ``feature_mode``: ``"last"`` (last hidden after the final norm, EAGLE-1 and MTP),
    ``"eagle3"`` (residual inputs of layers (2, L//2, L-3) concatenated, ``[T, 3*Ht]``),
    ``"none"`` (``[T, 0]``, standalone drafts). Wrapping a loaded model switches it to the
    ``"phasegraph"`` attention implementation. Call :meth:`attach_kv` before :meth:`forward`.

    Sliding-window layers (Mistral ``sliding_window``, Qwen2/Qwen3 ``use_sliding_window`` from
    ``max_window_layers`` on) attend the window ending at each token, on both paths: the
    attention function reads the window transformers' module passes, the fused path the one
    :func:`~phasegraph.runtime.models.fused_decoder.layer_window` reads from the same module.
    :attr:`sliding_window` is the narrowest window of any layer (None: none).

    ``fused``: run the layers through :mod:`~phasegraph.runtime.models.fused_decoder` (merged
    projections, fused norm / rotary / activation kernels; the default where the layers allow
    it, :attr:`fused_reason` says why not otherwise) or through transformers' modules (False).

    Mixture-of-experts targets (Qwen3-MoE, Mixtral) run transformers' modules; a CUDA-graph
    capture runs their experts through an implementation without host synchronisation
    (:attr:`capture_experts`; :attr:`capture_reason` says why none where transformers has none).
    ``forward(..., routed_experts=True)`` also returns the experts
    each MoE layer chose for every token (:attr:`num_moe_layers`, :attr:`experts_per_token`).
    """

    def __init__(
        self, model: PreTrainedModel, feature_mode: str = "last", fused: bool | None = None
    ) -> None:
        config = model.config
        check_model_type(getattr(config, "model_type", None), type(model).__name__)
        if feature_mode not in FEATURE_MODES:
            raise ValueError(f"feature_mode must be one of {FEATURE_MODES}, got {feature_mode!r}")
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.config = config
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers
        self.feature_mode = feature_mode
        self.feature_layers: tuple[int, ...] = {
            "last": (),
            "eagle3": eagle3_feature_layers(self.num_layers),
            "none": (),
        }[feature_mode]
        self.feature_size: int = {"last": 1, "eagle3": 3, "none": 0}[
            feature_mode
        ] * self.hidden_size
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device
        self.kv_spec = KVSpec(
            num_layers=self.num_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim_of(config),
            dtype=self.dtype,
        )
        windows = [w for layer in model.model.layers if (w := layer_window(layer, config)) is not None]
        self.sliding_window: int | None = min(windows) if windows else None
        self.pool: KVPool | None = None
        self.tp = None  # a TensorParallelGroup once runtime/tensor_parallel.py sharded the layers
        self.routers = moe_routers(model)
        self.num_moe_layers: int = len(self.routers)
        self.experts_per_token: int = experts_per_token(config) if self.routers else 0
        # the experts implementation a CUDA-graph capture runs (eager calls keep transformers'),
        # or why the layers cannot be captured
        self.capture_experts, self.capture_reason = capture_experts(model) if self.routers else (None, None)
        self.fused_layers = None
        self.fused_reason: str | None = "switched off (fused=False)"
        if fused is not False:
            result = fuse_decoder(model)
            if isinstance(result, str):
                if fused:
                    raise UnsupportedModel(f"the fused decoder path cannot run this model: {result}")
                self.fused_reason = result
            else:
                self.fused_layers, self.fused_reason = result, None

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        feature_mode: str = "last",
        fused: bool | None = None,
        progress: bool = False,
    ) -> HFTarget:
        """Load ``config.json`` + safetensors (single file or sharded), strictly checked
        (``progress``: a bar over the tensors)."""
        return cls(load_causal_lm(directory, dtype, device, progress=progress), feature_mode, fused)

    @classmethod
    def from_pretrained_split(
        cls, directory: str | Path, dtype: torch.dtype | str, group, feature_mode: str = "last",
        progress: bool = False,
    ) -> HFTarget:
        """``group.rank``'s slice of the target in ``directory`` on ``group.device``, read one
        decoder layer at a time: host memory holds one whole layer, never the model
        (``progress``: a bar over the layers)."""
        from tqdm.auto import tqdm

        model, checkpoint = load_split_causal_lm(directory, dtype, group.device)
        target = cls(model, feature_mode, fused=True)
        indices = tqdm(range(target.num_layers), desc=f"loading {Path(directory).name}",
                       unit="layer", disable=not progress)
        layers = (fuse_layer(read_layer(model, checkpoint, i), model.config) for i in indices)
        shard_target(target, group, layers=layers)
        return target

    # -- modules the draft heads share -----------------------------------------------------------

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.model.embed_tokens

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.lm_head

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    def attach_kv(self, pool: KVPool) -> None:
        """Use ``pool`` (built from :attr:`kv_spec`) for every forward."""
        self.pool = check_pool_fits(pool, self.kv_spec, "the model")

    # -- forward --------------------------------------------------------------------------------

    @torch.no_grad()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        routes: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Ht] after the final norm, [T, Hf])
        """Run every decoder layer over the flattened tokens; write KV; return hidden, features
        (and append each MoE layer's chosen experts [T, k] to ``routes``)."""
        if self.pool is None:
            raise RuntimeError("HFTarget.attach_kv(pool) must be called before forward")
        if self.fused_layers is not None:
            if self.tp is not None:
                self.tp.start_forward()
            hidden, captured = run_fused_decoder(
                self.model, self.fused_layers, input_ids, positions, attn,
                self.pool.k, self.pool.v, self.feature_layers,
                all_reduce=None if self.tp is None else self.tp.all_reduce_,
                reduce_dtype=None if self.tp is None else self.tp.reduce_dtype,
            )
            return hidden, self._features(hidden, captured)
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids[None])  # [1, T, Ht]
        position_ids = positions[None]  # [1, T]
        position_embeddings = inner.rotary_emb(hidden, position_ids)  # (cos, sin) [1, T, D]
        captured: dict[int, torch.Tensor] = {}
        recording = (contextlib.nullcontext([]) if routes is None
                     else recording_routes(self.routers, self.experts_per_token))
        experts = contextlib.nullcontext()
        if self.capture_experts is not None and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            experts = experts_implementation(self.model, self.capture_experts)
        with forward_context(attn, self.pool, positions=positions), recording as chosen, experts:
            for idx, layer in enumerate(inner.layers[: self.num_layers]):
                if idx in self.feature_layers:
                    captured[idx] = hidden[0]  # residual input of layer idx, [T, Ht]
                out = layer(
                    hidden,
                    attention_mask=None,
                    position_ids=position_ids,
                    position_embeddings=position_embeddings,
                )
                hidden = out[0] if isinstance(out, tuple) else out  # [1, T, Ht]
        if routes is not None:
            routes.extend(chosen)  # [T, k] per MoE layer
        hidden = inner.norm(hidden)[0]  # [T, Ht]
        return hidden, self._features(hidden, captured)

    def use_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Capture the residual inputs of ``layers`` as EAGLE-3 features (a head trained on
        other layers than the default (2, L//2, L-3) declares them; see
        :func:`declared_eagle3_layers`)."""
        if self.feature_mode != "eagle3":
            raise DraftMismatch(f"feature layers apply to feature_mode 'eagle3'; this target's is {self.feature_mode!r}")
        if len(layers) != 3 or not all(0 <= i < self.num_layers for i in layers):
            raise DraftMismatch(f"EAGLE-3 feature layers must be three of 0..{self.num_layers - 1}; got {list(layers)}")
        self.feature_layers = tuple(layers)

    def _features(self, hidden: torch.Tensor, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        if self.feature_mode == "last":
            return hidden  # [T, Ht]
        if self.feature_mode == "eagle3":
            return torch.cat([captured[i] for i in self.feature_layers], dim=-1)  # [T, 3Ht]
        return hidden.new_empty(hidden.shape[0], 0)  # [T, 0]

    @torch.no_grad()
    def logits(
        self,
        hidden: torch.Tensor,  # [T, Ht] after the final norm
        logits_index: torch.Tensor | None = None,  # [R] int64
    ) -> torch.Tensor:  # [R, V] float32
        rows = hidden if logits_index is None else take_rows(hidden, logits_index)
        head = self.model.lm_head
        if type(head) is torch.nn.Linear:  # the skinny product where its table says it wins
            # on GPUs a half lm_head's float32 sums are kept: bf16 logits tie, or step by an ulp
            out_dtype = torch.float32 if rows.is_cuda else None
            return linear(rows, head.weight, head.bias, static_weight=True, out_dtype=out_dtype).float()
        return head(rows).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        logits_index: torch.Tensor | None = None,  # [R] int64, None = every row
        *,
        routed_experts: bool = False,
    ) -> TargetOutput:
        """``routed_experts``: also return the experts every MoE layer chose for each token
        ([T, num_moe_layers, k] int64, layer order)."""
        if not routed_experts:
            hidden, features = self.hidden_states(input_ids, positions, attn)
            return TargetOutput(logits=self.logits(hidden, logits_index), features=features)
        if not self.routers:
            raise UnsupportedModel(f"routed experts were asked of a {self.config.model_type} target, which has no "
                                   "mixture-of-experts layers")
        routes: list[torch.Tensor] = []
        hidden, features = self.hidden_states(input_ids, positions, attn, routes)
        if len(routes) != self.num_moe_layers:  # a router called twice, or skipped, per forward
            raise UnsupportedModel(f"{len(routes)} router calls in one forward of {self.num_moe_layers} MoE layers")
        return TargetOutput(logits=self.logits(hidden, logits_index), features=features,
                            routed_experts=torch.stack(routes, dim=1))  # [T, M, k]

    __call__ = forward
