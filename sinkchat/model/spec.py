"""`ModelSpec`: the one description of a decoder that the cache, the re-rotation, the gauge, both decode steps and the
loader read. Built once from the transformers config and modules (`ModelSpec.from_model`); nothing else looks at
`model.config` for dims, heads, RoPE, norms, activation or linear names.

Why one description: before it, four places introspected the model and already disagreed (the cache re-rotated with
`original_inv_freq`, the native step with `inv_freq`; the head-dim rule was written twice). A new architecture now
means teaching `from_model` and, if the decode steps cannot run it, saying so in `fast_step_refusal`.

What sinkchat cannot run is refused here, in `refusal` (config-only checks, usable before any weight is read) and
`ModelSpec.refusal` (the built description), each with one line that names the model type and the feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinkchat.errors import UserError

if TYPE_CHECKING:
    import torch

    from sinkchat.model.rope import Rope

# rope_type values whose inverse frequencies do not depend on the position (for positions below the trained
# context, which in-cache positions never exceed), so a shift by -n is the exact inverse of a shift by +n.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional")
# model types both fast decode steps (native C and torch) implement; others decode through transformers' forward
FAST_STEP_TYPES = ("llama", "qwen2", "mistral")
# the native C step also runs per-head q/k RMSNorm (Qwen3), partial rotary and fused qkv / gate_up linears (Phi-3),
# and Gemma 2 / 3: (1 + w) norms, output norms, GELU, soft-capping, a RoPE and a cache slice per layer (sc_layers)
NATIVE_STEP_TYPES = (*FAST_STEP_TYPES, "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")
NATIVE_HEAD_DIM_MULTIPLE = 16  # the C attention sums 16 lanes at a time
ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
_NO_ROPE = ("model type '{}' has no rotary position embedding (RoPE) that sinkchat can find; only RoPE models "
            "(Llama, Qwen2, Mistral, Gemma, Phi-3, ...) are supported")


class UnsupportedModel(UserError, ValueError):
    """The model has a feature sinkchat's cache or decode steps cannot run; the message names it."""


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rotary embedding: fp32 inverse frequencies [rot_dim/2] as the model computes them at load."""

    rope_type: str
    base: float
    inv_freq: tuple[float, ...]
    attention_scaling: float  # the cos/sin multiplier of yarn / longrope (1.0 otherwise)

    @property
    def rot_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True)
class LayerSpec:
    attention: str  # "full" | "sliding"
    window: int | None  # sliding layers: how many past tokens a query sees
    rope: RopeSpec
    scaling: float  # the softmax scale of q·k (head_dim**-0.5, or Gemma's query_pre_attn_scalar**-0.5)


@dataclass(frozen=True)
class NormSpec:
    kind: str  # "rms"
    eps: float
    qk_norm: bool  # RMSNorm on each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich: bool  # extra norms after attention and after the MLP (Gemma 2 / 3)
    unit_offset: bool  # weights stored as w - 1: the norm multiplies by (1 + w) (Gemma)


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv: int
    head_dim: int
    inter: int
    vocab: int
    max_positions: int
    layers: tuple[LayerSpec, ...]
    norm: NormSpec
    act: str  # "silu" | "gelu_tanh" | the config's name when neither
    tied: bool
    attn_bias: bool
    embed_scale: float  # Gemma multiplies embeddings by sqrt(dim)
    attn_softcap: float | None
    final_softcap: float | None
    linears: tuple[str, ...]  # dotted names inside a decoder layer, e.g. "self_attn.q_proj"

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def from_model(cls, model: Any) -> "ModelSpec":
        """Read the config and the modules once. Raises UnsupportedModel where no spec can be built (no RoPE)."""
        cfg = model.config
        check_config(cfg)
        base = getattr(model, "model", model)
        if getattr(base, "rotary_emb", None) is None:
            raise UnsupportedModel(_NO_ROPE.format(_name(cfg)))
        layers = getattr(base, "layers", None)
        if layers is None or not len(layers):
            raise UnsupportedModel(f"model type '{_name(cfg)}' has no decoder layer stack sinkchat can find")
        n_heads, n_kv, head_dim = attention_shape(cfg)
        kinds = _layer_kinds(cfg, len(layers))
        window = getattr(cfg, "sliding_window", None)
        layer_specs = tuple(
            LayerSpec(attention=k, window=int(window) if k == "sliding" and window else None,
                      rope=_rope_of(cfg, base, t), scaling=float(getattr(layer.self_attn, "scaling", head_dim**-0.5)))
            for layer, (k, t) in zip(layers, kinds))
        layer0 = layers[0]
        emb = model.get_input_embeddings()
        return cls(
            model_type=_name(cfg), n_layers=len(layers), dim=int(cfg.hidden_size), n_heads=n_heads, n_kv=n_kv,
            head_dim=head_dim, inter=int(getattr(cfg, "intermediate_size", 0) or 0), vocab=int(cfg.vocab_size),
            max_positions=max_positions(cfg), layers=layer_specs, norm=_norm_of(layer0),
            act=_act_of(cfg), tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            attn_bias=getattr(getattr(layer0.self_attn, "q_proj", None), "bias", None) is not None,
            embed_scale=float(getattr(emb, "scalar_embed_scale", 1.0)),
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
            final_softcap=getattr(cfg, "final_logit_softcapping", None),
            linears=_linears_of(layer0),
        )

    # ------------------------------------------------------------------------------------------- what runs
    def refusal(self) -> str | None:
        """Why sinkchat's sink cache cannot hold this model (None: it can). The one place such features are refused.

        Full and sliding-window layers may mix (Gemma 2 / 3): global layers keep the sinks + window, local ones the
        last tokens of their one window (`core/hybrid_cache.py`), each re-rotated with its own RoPE."""
        kinds = sorted({layer.attention for layer in self.layers})
        other = [k for k in kinds if k not in ("full", "sliding")]
        if other:
            return (f"model type '{self.model_type}' uses attention kind(s) {', '.join(other)}; sinkchat's cache "
                    "supports full and sliding-window attention layers")
        windows = sorted({layer.window or 0 for layer in self.layers if layer.attention == "sliding"})
        if 0 in windows:
            return f"model type '{self.model_type}' has sliding-window layers without a window size"
        if len(windows) > 1:
            return (f"model type '{self.model_type}' slides over different windows ({', '.join(map(str, windows))}); "
                    "sinkchat's cache keeps one window for every local layer")
        for layer in self.layers:
            rot = layer.rope.rot_dim
            if rot > self.head_dim or rot == 0:
                return f"model type '{self.model_type}': rotary dim {rot} does not fit head dim {self.head_dim}"
        return None

    @property
    def hybrid(self) -> bool:
        """Full-attention (global) and sliding-window (local) layers mixed, as in Gemma 2 / 3."""
        return len({layer.attention for layer in self.layers}) > 1

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers the sink policy governs (the full-attention ones; every layer of a non-hybrid model)."""
        if not self.hybrid:
            return tuple(range(self.n_layers))
        return tuple(i for i, layer in enumerate(self.layers) if layer.attention == "full")

    @property
    def local_window(self) -> int | None:
        """A hybrid model's local window: how many tokens (the current one included) a sliding layer sees."""
        if not self.hybrid:
            return None
        return next(layer.window for layer in self.layers if layer.attention == "sliding")

    @property
    def context_limit(self) -> int:
        """The most tokens the cache may hold: the trained context, and for a model whose every layer slides (Mistral
        style) its window too. Within it the window never bites, so every layer attends to the whole cache."""
        windows = [layer.window for layer in self.layers if layer.window]
        return min([self.max_positions, *windows]) if len(windows) == len(self.layers) else self.max_positions

    def check(self) -> "ModelSpec":
        reason = self.refusal()
        if reason:
            raise UnsupportedModel(reason)
        return self

    def fast_step_refusal(self, native: bool) -> str | None:
        """Why the fast decode steps (native C when `native`, else the torch step) cannot take this model's shape
        (None: they can; whether its weights are packed for them is the step's own check). The native step runs
        q/k norms, partial rotary and fused projections; the torch step (`torch_step.decode_one`) none of them."""
        types = NATIVE_STEP_TYPES if native else FAST_STEP_TYPES
        if self.model_type not in types:
            return f"model type {self.model_type!r} ({'native' if native else 'torch'} fast step: {', '.join(types)})"
        gemma = native and self.model_type in GEMMA_TYPES  # sc_step_layers: everything below but a RoPE's width
        if self.act != "silu" and not (gemma and self.act == "gelu_tanh"):
            return f"activation {self.act}"
        if (self.norm.sandwich or self.norm.unit_offset or (self.norm.qk_norm and not native)) and not gemma:
            return "norm variant"
        if not native and (self.layers[0].rope.rot_dim != self.head_dim or any("qkv" in n or "gate_up" in n
                                                                               for n in self.linears)):
            return "partial rotary or fused projections (the native step runs them)"
        if (self.attn_softcap or self.final_softcap or self.sliding_window_bites()) and not gemma:
            return "attention variant"
        if len({layer.rope for layer in self.layers}) > 1 and not gemma:
            return "a RoPE per layer"
        if len({layer.rope.rot_dim for layer in self.layers}) > 1:
            return "rotary dims differing between layers"
        if native and not native_head_dim_ok(self.head_dim):
            return f"head dim {self.head_dim} (the C attention takes multiples of {NATIVE_HEAD_DIM_MULTIPLE})"
        return None

    def sliding_window_bites(self) -> bool:
        """Whether some layer's window can hide cached tokens from a query. Not for a model whose every layer slides
        (Mistral): `context_limit` caps the cache at the window, so each layer attends to the whole cache, as the
        fast steps do. A hybrid (Gemma 2 / 3) model's local windows do bite: the torch step declines it; the native step
        attends each local layer over its ring (`HybridKVCache.buffers`).)"""
        windows = [layer.window for layer in self.layers if layer.window]
        return bool(windows) and len(windows) < len(self.layers)

    def rope(self, layer: int = 0) -> "Rope":
        """The torch-side rotation helper for `layer` (fp32 inverse frequencies)."""
        import torch

        from sinkchat.model.rope import Rope

        spec = self.layers[layer].rope
        return Rope(inv_freq=torch.tensor(spec.inv_freq, dtype=torch.float32), head_dim=self.head_dim)

    def ropes(self) -> list["Rope"]:
        """One rotation helper per layer; layers with the same RoPE share one object, so the cos/sin an eviction
        computes for a shift serves every layer of that kind (Gemma 3: local base 10k, global base 1M + scaling)."""
        by_spec: dict[RopeSpec, int] = {}
        made: list["Rope"] = []
        for i, layer in enumerate(self.layers):
            if layer.rope not in by_spec:
                by_spec[layer.rope] = len(made)
                made.append(self.rope(i))
        return [made[by_spec[layer.rope]] for layer in self.layers]

    def inv_freq(self, layer: int = 0) -> "torch.Tensor":
        import torch

        return torch.tensor(self.layers[layer].rope.inv_freq, dtype=torch.float32)

    def kv_bytes_per_token(self, bits: int) -> int:
        """Bytes one token's keys and values take in every layer at `bits` per element."""
        return 2 * self.n_layers * self.n_kv * self.head_dim * bits // 8


# ----------------------------------------------------------------------------------------------- config-only
def attention_shape(hf_config: Any) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of a transformers model config, with the fallbacks every family uses
    (no `num_key_value_heads`: one kv head per query head; no `head_dim`: hidden size / heads)."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads


def attention_implementation(hf_config: Any) -> str:
    """The transformers attention to load a model with: sdpa, except where transformers refuses it (Gemma 2 soft-caps
    attention scores, which its sdpa path cannot do)."""
    return "eager" if getattr(hf_config, "attn_logit_softcapping", None) else "sdpa"


def max_positions(hf_config: Any) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)


def native_head_dim_ok(head_dim: int) -> bool:
    return head_dim % NATIVE_HEAD_DIM_MULTIPLE == 0


def check_config(cfg: Any) -> None:
    """Refuse from the config alone (before any weight is read) what no spec can describe: RoPE types that
    cannot be re-rotated, bidirectional attention (EmbeddingGemma: no causal stream to cache). Raises
    UnsupportedModel."""
    if getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "is_causal", True) is False:
        raise UnsupportedModel(f"model type '{_name(cfg)}' attends bidirectionally; sinkchat's cache needs a causal "
                               "decoder")
    for params in _rope_params_by_type(cfg).values():
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"model type '{_name(cfg)}' uses RoPE type '{rope_type}', which sinkchat cannot "
                                   "re-rotate")


def _name(cfg: Any) -> str:
    return str(getattr(cfg, "model_type", "?"))


def _rope_params_by_type(cfg: Any) -> dict[str, dict]:
    """{layer type or "": rope parameters}: transformers 5 nests them per layer type for hybrid models (Gemma 3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) or v is None for v in params.values()):
        return {k: (v or {}) for k, v in params.items()}
    return {"": params if isinstance(params, dict) else {}}


def _layer_kinds(cfg: Any, n: int) -> list[tuple[str, str]]:
    """(attention kind, layer type name) per layer."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    out = []
    for t in types[:n]:
        kind = "sliding" if "sliding" in str(t) else "full" if "full" in str(t) else str(t)
        out.append((kind, str(t)))
    if getattr(cfg, "layer_types", None) is None and getattr(cfg, "use_sliding_window", True) and getattr(
            cfg, "sliding_window", None):
        out = [("sliding", "sliding_attention")] * n  # Mistral style: every layer slides
    return out


def _rope_of(cfg: Any, base: Any, layer_type: str) -> RopeSpec:
    emb = getattr(base, "rotary_emb", None)
    by_type = _rope_params_by_type(cfg)
    params = by_type.get(layer_type) or by_type.get("") or next(iter(by_type.values()), {})
    inv = None
    scaling = 1.0
    if emb is not None:
        inv = getattr(emb, f"{layer_type}_original_inv_freq", None)
        if inv is not None:
            scaling = float(getattr(emb, f"{layer_type}_attention_scaling", 1.0))
        else:
            inv = getattr(emb, "original_inv_freq", None)
            inv = inv if inv is not None else getattr(emb, "inv_freq", None)
            scaling = float(getattr(emb, "attention_scaling", 1.0))
    if inv is None:
        raise UnsupportedModel(_NO_ROPE.format(_name(cfg)))
    values = tuple(float(x) for x in inv.detach().to("cpu").float().tolist())
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 0.0)) or 0.0)
    return RopeSpec(rope_type=str(params.get("rope_type", "default")), base=theta, inv_freq=values,
                    attention_scaling=scaling)


def _norm_of(layer: Any) -> NormSpec:
    norm = layer.input_layernorm
    eps = getattr(norm, "variance_epsilon", None)
    eps = float(eps if eps is not None else getattr(norm, "eps", 1e-6))
    attn = layer.self_attn
    unit_offset = "gemma" in type(norm).__name__.lower()
    return NormSpec(kind="rms", eps=eps, qk_norm=hasattr(attn, "q_norm") or hasattr(attn, "k_norm"),
                    sandwich=hasattr(layer, "pre_feedforward_layernorm"), unit_offset=unit_offset)


def _act_of(cfg: Any) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu") or "silu"
    return {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act)


def _linears_of(layer: Any) -> tuple[str, ...]:
    names = []
    for part, candidates in (("self_attn", ATTN_LINEARS), ("mlp", MLP_LINEARS)):
        mod = getattr(layer, part, None)
        names += [f"{part}.{n}" for n in candidates if getattr(mod, n, None) is not None]
    return tuple(names)

