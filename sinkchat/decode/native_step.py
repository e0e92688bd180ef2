"""The native decode step: one token through every layer in one C call (`csrc/step.c: sc_step`), over the sink
cache's own K/V buffers.

Why: with the matmuls in sinkchat's VNNI kernels, what is left of a token is ~20 small operations a layer; through
torch each costs a dispatch (~5-10 us), through transformers' forward ~14 ms a token in all. In C they cost what
their arithmetic costs, and one ctypes call per token replaces dynamo's guards and inductor's build (no compiler
stack in the process: ~85 MB less RSS than the compiled step, and no 1.5-minute first build).

Same math as `torch_step.decode_one` and transformers' forward (RMSNorm, rotate-half RoPE at the in-cache slot,
GQA softmax attention over slots <= pos, SiLU MLP), with attention in fp32 over K/V stored as the cache's dtype
(fp32 or bf16). Beyond the torch step: each linear may be q4 (`Int4Linear`), q8g (`Int8GLinear`), or the K-quants'
q4k / q8k (`Int4KLinear`, `Int8KLinear`: tests/test_qk.py), as a GGUF of mixed types loads; Qwen3's per-head q/k
RMSNorm; partial rotary; Phi-3's fused qkv_proj / gate_up_proj, passed to C as row-group views of the fused weights
(no copy). Gemma 2 / 3 through `sc_step_layers` (a `native.StepLayers` beside the Model): a RoPE, query scale and
cache slice per layer (local rings: `HybridKVCache.buffers`), (1 + w) norms folded here, output norms, GELU,
soft-capping. Tests stream tiny Llama, Qwen2 (tests/test_native.py), Qwen3, Mistral, Phi-3
(tests/test_native_archs.py), Gemma 2 and 3 (tests/test_native_gemma.py) models through it and through transformers
and compare.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch

from sinkchat.model import int4
from sinkchat.model.int4q0 import Int4Q0Linear
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.int5 import Int5KLinear, Int5Q0Linear, Int5Q1Linear
from sinkchat.model.int8q0 import Int8Q0Linear
from sinkchat.model.intk import Int4KLinear, Int6KLinear, Int8KLinear
from sinkchat.kernels import native
from sinkchat.decode.native_prefill import NativePrefill
from sinkchat.model.spec import GEMMA_TYPES, ModelSpec

log = logging.getLogger(__name__)

# the order `sc_step` reads each layer's (weights, scales, bias) triples in (csrc/step.c)
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # Phi-3: parts in this order along the rows
_LIN_TYPE = {"q4": 0, "q8g": 1, "q4k": 2, "q8k": 3, "q40": 5, "q6k": 6, "q80": 7, "q50": 8, "q51": 9,
             "q5k": 10}  # csrc/kernels.h: SC_LIN_*
_PACKED = (int4.Int4Linear, Int8GLinear, Int4KLinear, Int8KLinear, Int4Q0Linear, Int6KLinear, Int8Q0Linear,
           Int5Q0Linear, Int5Q1Linear, Int5KLinear)  # one per layout above


def why_not(model: Any, spec: ModelSpec) -> str | None:
    """Why `NativeStep` cannot run this model (None: it can): the kernels, the spec's shape, the packed weights."""
    return native.why_unavailable() or spec.fast_step_refusal(native=True) or _weights_refusal(model, spec)


def _is_native(lin: Any) -> bool:
    return isinstance(lin, _PACKED) and lin.kernels == "native"


def _weights_refusal(model: Any, spec: ModelSpec) -> str | None:
    """Why the model's modules are not what `sc_step` reads: fp32 norms on the CPU, every linear packed for the
    native kernels (q4, q8g, q4k, q8k or q40), fused projections splittable at 16-row boundaries, q/k norms of one head's
    width."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        return "no decoder stack"
    weight = getattr(getattr(base, "norm", None), "weight", None)
    if weight is None:
        return "final norm without weight"
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return "not fp32 on the CPU"
    if any(name not in _LINEARS and name not in _FUSED for name in spec.linears):
        return f"linears {spec.linears}"
    for layer in base.layers:
        lins = [layer.get_submodule(name) for name in spec.linears]
        if not all(_is_native(lin) for lin in lins):
            return "linears not all packed for the native kernels (q4, q8g, q4k, q8k or q40)"
        if hasattr(layer.self_attn, "sinks"):
            return "attention variant (learned sinks)"
        if spec.norm.qk_norm and not all(_per_head_norm(getattr(layer.self_attn, n, None), spec)
                                         for n in ("q_norm", "k_norm")):
            return "q/k norms not RMSNorms of one head's width with the model's eps"
        if any(getattr(getattr(layer, n, None), "weight", None) is None for n in _norm_names(spec) if n):
            return f"layer norms {_norm_names(spec)}"
    if "mlp.gate_up_proj" in spec.linears and spec.inter % native.RG:
        return f"fused gate_up split at {spec.inter}, not a multiple of {native.RG} rows"
    return None


def _norm_names(spec: ModelSpec) -> tuple[str, str, str | None, str | None]:
    """A layer's norms as sc_step reads them: (attention input, MLP input, attention output, MLP output); Gemma 2 /
    3 norm each block's output too, and name the MLP's input norm pre_feedforward_layernorm."""
    if spec.norm.sandwich:
        return ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                "post_feedforward_layernorm")
    return "input_layernorm", "post_attention_layernorm", None, None


def _per_head_norm(norm: Any, spec: ModelSpec) -> bool:
    """A q/k norm `sc_step` computes: a weight of head_dim, and the eps of the layer norms (Model.eps serves both)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return weight is not None and weight.numel() == spec.head_dim and eps is not None and float(eps) == spec.norm.eps


def _parts(layer: Any, spec: ModelSpec) -> list[tuple[Any, int, int]]:
    """The 7 linears `sc_step` reads for one layer, in `_LINEARS` order, as (module, first row, rows): a fused
    module (Phi-3's qkv_proj, gate_up_proj) gives one part per projection, rows [first, first + rows) of it."""
    hd, kvd = spec.n_heads * spec.head_dim, spec.n_kv * spec.head_dim
    rows = {"self_attn.q_proj": hd, "self_attn.k_proj": kvd, "self_attn.v_proj": kvd, "mlp.gate_proj": spec.inter,
            "mlp.up_proj": spec.inter}
    out: dict[str, tuple[Any, int, int]] = {}
    for name in spec.linears:
        mod = layer.get_submodule(name)
        if name in _FUSED:
            first = 0
            for part in _FUSED[name]:
                out[part] = (mod, first, rows[part])
                first += rows[part]
            if first != mod.out_features:
                raise ValueError(f"{name}: {mod.out_features} rows, expected {first}")
        else:
            out[name] = (mod, 0, mod.out_features)
    return [out[name] for name in _LINEARS]


def _rows_of(lin: Any, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, scales, fp32 bias or None) of rows [first, first + n) of a packed linear: views of its row groups
    (the weight blocks, qw or hw, and sw are [N/16, ...], so a 16-row-aligned split is a contiguous view, no copy)."""
    g0, g1 = first // native.RG, (first + n) // native.RG
    bias = None if lin.bias is None else lin.bias.detach()[first : first + n].float().contiguous()  # C reads fp32
    weights = lin.hw if lin.layout == "q8k" else lin.qw
    return weights[g0:g1], lin.sw[g0:g1], bias


@dataclass(frozen=True)
class _Head:
    """Where the step's logits come from: C projects with a tied int8 table (`table`: an `Int8Head`'s) or a packed
    head (`packed`: a GGUF's untied one of the model's width); anything else (`torch`) is applied after the step."""

    table: Any
    packed: Any
    torch: Any
    vocab: int  # the logits' columns
    c_vocab: int  # rows of logits C writes: the table's (padded to 16), the packed head's, or 0 (C returns hidden)


def _choose_head(model: Any, spec: ModelSpec) -> _Head:
    """Which of the three heads `model`'s output embeddings are (`_Head`)."""
    head = model.get_output_embeddings()
    if isinstance(head, int4.Int8Head) and head.table.kernels == "native":
        table = head.table
        return _Head(table, None, None, table.num_embeddings, table.hw.shape[0] * native.RG)
    if _is_native(head) and head.in_features == spec.dim:  # a GGUF's
        return _Head(None, head, None, head.out_features, head.out_features)
    return _Head(None, None, head, spec.vocab, 0)


class NativeStep:
    """The Engine's single-token path on the native kernels: `__call__` as `torch_step.TorchStep`'s (logits,
    pre-RoPE queries, gauge shares [L, 3]). Nothing to build beyond the kernels' library, so `prepare` / `warm_up` do
    nothing and the status is always "native (<kernel variant>; prefill native|hf)"."""

    mode = "native"
    status = "native"
    failed = None

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.n_layers = spec.n_layers
        self.n_heads, self.n_kv, self.head_dim = spec.n_heads, spec.n_kv, spec.head_dim
        self.embed = model.get_input_embeddings()  # called as a module: an Int8Embedding or any other lookup
        head = _choose_head(model, spec)
        self.head, self.vocab = head.torch, head.vocab
        self._unit = spec.norm.unit_offset  # Gemma: norms multiply by 1 + w; folded here so C multiplies by w
        self.final_softcap = spec.final_softcap  # Gemma 2: tanh(logits / cap) * cap, after the head (in torch)
        # keep every tensor the struct points into alive for the step's lifetime
        self._keep: list[torch.Tensor] = [spec.inv_freq(0).contiguous()]
        self._m = self._model_struct(model.model, spec, head)
        self._out = self._m.vocab or spec.dim  # logits where C has a head, else the final hidden state
        self._kv: tuple[Any, ...] = ()
        _, _, attn_out, mlp_out = _norm_names(spec)
        self._layers = (self._per_layer(model.model.layers, spec, attn_out, mlp_out)
                        if spec.model_type in GEMMA_TYPES else None)
        self.prefill = NativePrefill.for_step(self, spec)  # chunks in one C call (native_prefill.py), or None
        self.memory_region = True  # attends a recall region in front of its global layers' streams (`base`, `used`)
        self.global_layers = spec.global_layers
        # what status lines show: which kernels' library runs the step, and which path feeds chunks
        self.status = f"native ({native.variant()}; prefill {'native' if self.prefill is not None else 'hf'})"

    def _model_struct(self, base: Any, spec: ModelSpec, head: _Head) -> native.StepModel:
        """The sc_model struct `sc_step` reads: shapes, norms (stacked per layer), every linear's (weights, scales,
        bias) pointers and layout, the head C projects with; each tensor kept alive in `_keep`."""
        layers = base.layers
        norm_in, norm_mlp, _, _ = _norm_names(spec)
        ins = [self._stack([layer.get_submodule(n).weight for layer in layers]) for n in (norm_in, norm_mlp)]
        final = self._stack([base.norm.weight])
        qk = [self._stack([layer.self_attn.get_submodule(n).weight for layer in layers]) if spec.norm.qk_norm else None
              for n in ("q_norm", "k_norm")]
        self._lin, self._types = self._linears(layers, spec)
        table, packed = head.table, head.packed
        if table is not None:
            self._keep += [table.hw, table.scale]
        self._head = self._head_triple(packed)
        return native.StepModel(
            n_layers=self.n_layers, dim=spec.dim, n_heads=self.n_heads, n_kv=self.n_kv,
            head_dim=self.head_dim, inter=spec.inter,
            vocab=head.c_vocab, kv_bf16=0,
            eps=spec.norm.eps, scaling=spec.layers[0].scaling, rope_scale=spec.layers[0].rope.attention_scaling,
            inv_freq=self._keep[0].data_ptr(), norm_in=ins[0].data_ptr(), norm_post=ins[1].data_ptr(),
            norm_final=final.data_ptr(), lin=ctypes.cast(self._lin, ctypes.c_void_p),
            table=None if table is None else table.hw.data_ptr(),
            table_scale=None if table is None else table.scale.data_ptr(),
            q_norm=None if qk[0] is None else qk[0].data_ptr(), k_norm=None if qk[1] is None else qk[1].data_ptr(),
            lin_type=ctypes.cast(self._types, ctypes.c_void_p), rot=spec.layers[0].rope.rot_dim,
            head=None if packed is None else ctypes.cast(self._head, ctypes.c_void_p),
            head_type=0 if packed is None else _LIN_TYPE[packed.layout])

    def _linears(self, layers: Any, spec: ModelSpec) -> tuple[Any, Any]:
        """The C arrays of every layer's 7 (weights, scales, bias) pointers in `_LINEARS` order, and their layouts
        (`_LIN_TYPE`); the tensors pointed into kept alive."""
        ptrs, types = [], []
        for layer in layers:
            for lin, first, n in _parts(layer, spec):
                parts = _rows_of(lin, first, n)
                self._keep += [t for t in parts if t is not None]  # what the pointers point into
                ptrs += [t.data_ptr() if t is not None else None for t in parts]
                types.append(_LIN_TYPE[lin.layout])
        return (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * len(types))(*types)

    def _head_triple(self, head: Any) -> Any:
        """The C array (weights, scales, bias) of a packed output head (its whole rows), or None.

        Why in C: applied here in torch it was one more call out of Python after the step, and the pool's workers
        had gone to sleep by then: the ~1B Q4_0 model's 41 MB head took 1.9 ms a token (21 GB/s) against the
        step's 20 ms for 630 MB (31 GB/s)."""
        if head is None:
            return None
        parts = _rows_of(head, 0, head.out_features)
        self._keep += [t for t in parts if t is not None]
        return (ctypes.c_void_p * 3)(*[t.data_ptr() if t is not None else None for t in parts])

    def _stack(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """fp32 [L, D] of per-layer norm weights, kept alive with the step; Gemma's 1 + w formed here, in fp32 as
        its RMSNorm forms it (then C's `w * (x * r)` is its `(x * r) * (1 + w)`: the same product)."""
        t = torch.stack([w.detach().float() + 1.0 if self._unit else w.detach().float() for w in weights])
        self._keep.append(t.contiguous())
        return self._keep[-1]

    def _per_layer(self, layers: Any, spec: ModelSpec, attn_out: str | None, mlp_out: str | None
                   ) -> native.StepLayers:
        """The sc_layers struct (Gemma 2 / 3): each layer's RoPE, cos/sin multiplier and query scale, the block
        output norms, GELU, the attention soft-cap."""
        per = [torch.stack([spec.inv_freq(i) for i in range(spec.n_layers)]).contiguous(),
               torch.tensor([ls.rope.attention_scaling for ls in spec.layers], dtype=torch.float32),
               torch.tensor([ls.scaling for ls in spec.layers], dtype=torch.float32)]
        self._keep += per
        outs = [None if n is None else self._stack([layer.get_submodule(n).weight for layer in layers])
                for n in (attn_out, mlp_out)]
        act = {"silu": native.ACT_SILU, "gelu_tanh": native.ACT_GELU_TANH}[spec.act]
        return native.StepLayers(
            inv_freq=per[0].data_ptr(), rope_scale=per[1].data_ptr(), scaling=per[2].data_ptr(),
            norm_attn_out=None if outs[0] is None else outs[0].data_ptr(),
            norm_mlp_out=None if outs[1] is None else outs[1].data_ptr(), softcap=spec.attn_softcap or 0.0, act=act)

    @classmethod
    def for_model(cls, model: Any, spec: ModelSpec) -> "NativeStep | None":
        reason = why_not(model, spec)
        if reason is not None:
            log.info("native decode step off: %s", reason)
            return None
        return cls(model, spec)

    def __call__(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int = 4,
                 base: int = 0, used: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token `tok` at slot `pos`: writes its k/v there, returns logits [1, V], queries [L, H*D], gauge [L, 3]
        (per layer the attention shares on the stream's first / newest `n_gauge` slots and on the recalled ones).
        Gemma: a layer's buffer may be a view shorter than its buffer (a local ring's window, the token's slot last:
        `HybridKVCache.buffers`). `base`: slots in front of the stream in every buffer (the recall memory's), the
        last `used` of them attended too (stream slot i is buffer slot base + i, at RoPE position i)."""
        if base:
            return self._call_region(tok, pos, keys, values, n_gauge, base, used)
        if self._layers is not None:
            return self._call_layers(tok, pos, keys, values, n_gauge)
        cap = keys[0].shape[2]
        kp, vp = self._pointers(keys, values)
        if not 0 <= pos < cap:
            raise ValueError(f"slot {pos} outside the cache (capacity {cap})")
        with torch.no_grad():
            x = self.embed(torch.tensor([tok])).float().contiguous()  # [1, C]
        out = torch.empty(self._out)
        queries = torch.empty(self.n_layers, self.n_heads * self.head_dim)
        gauge = torch.empty(self.n_layers, 3)  # first / newest / recalled shares
        if native.sc_step(self._m, x.data_ptr(), pos, n_gauge, kp, vp, cap,
                          out.data_ptr(), queries.data_ptr(), gauge.data_ptr()):
            raise MemoryError("the native decode step ran out of memory")
        return self._logits(out), queries, gauge

    def _pointers(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[Any, Any]:
        """The C arrays of whole buffers' addresses, checked (`_check_buffers`) and built again only when a buffer
        moved (a new cache may reuse some addresses: every one is compared); `kv_bf16` set for their dtype. The
        decode step, the prefill and the recall-region path all go through here."""
        k0 = keys[0]
        ptrs = tuple(b.data_ptr() for b in keys + values)
        key = (ptrs, k0.shape[2], k0.dtype)
        if not self._kv or self._kv[0] != key:
            self._check_buffers(keys, values)
            kp = (ctypes.c_void_p * len(keys))(*ptrs[: len(keys)])
            vp = (ctypes.c_void_p * len(values))(*ptrs[len(keys) :])
            self._kv = (key, kp, vp, keys + values)  # the tensors too: their memory must outlive the pointers
        self._m.kv_bf16 = int(k0.dtype == torch.bfloat16)
        return self._kv[1], self._kv[2]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """[1, V] from the C step's output: its logits, or the head applied here; Gemma 2's final soft-cap."""
        if self.head is not None:
            with torch.no_grad():
                logits = self.head(out[None]).float()  # [1, V]
        else:
            logits = out[None, : self.vocab]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _call_layers(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`__call__` through sc_step_layers: per layer its buffer's stride (cap) and the slots attended (n): a
        whole buffer, slots 0..pos; a view shorter than its buffer (a ring's window), all of it."""
        caps, ns = self._slices(keys, values, pos)
        return self._run_layers(tok, pos, n_gauge, self._layers, [b.data_ptr() for b in keys],
                                [b.data_ptr() for b in values], caps, ns, keys[0].dtype)

    def _call_region(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int,
                     base: int, used: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`__call__` over buffers with a recall region: sc_step_layers with each global layer's pointer at its
        first attended slot (base - used), attending `used` + pos + 1 slots, the token written last; a hybrid
        model's local rings as `_call_layers` passes them."""
        if self._layers is None:
            self._pointers(keys, values)  # checked once per set of buffers, as the plain step checks them
            caps, ns = [keys[0].shape[2]] * self.n_layers, [pos + 1] * self.n_layers
        else:
            caps, ns = self._slices(keys, values, pos)
        kp, vp = [b.data_ptr() for b in keys], [b.data_ptr() for b in values]
        skip = (base - used) * self.head_dim * keys[0].element_size()
        for layer in self.global_layers:
            if not 0 <= used <= base or not 0 <= base + pos < caps[layer]:
                raise ValueError(f"slot {pos} (memory {used} of {base}) outside the cache ({caps[layer] - base})")
            kp[layer], vp[layer], ns[layer] = kp[layer] + skip, vp[layer] + skip, used + pos + 1
        return self._run_layers(tok, pos, n_gauge, self._layers, kp, vp, caps, ns, keys[0].dtype)

    def _run_layers(self, tok: int, pos: int, n_gauge: int, layers: native.StepLayers | None, keys: list[int],
                    values: list[int], caps: list[int], ns: list[int], dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sc_step_layers call: layer l's K/V at addresses keys[l] / values[l], heads caps[l] slots apart, the
        token at RoPE position pos attending ns[l] slots and written last."""
        self._m.kv_bf16 = int(dtype == torch.bfloat16)
        with torch.no_grad():
            x = self.embed(torch.tensor([tok])).float().contiguous()  # [1, C]
        out = torch.empty(self._out)
        queries = torch.empty(self.n_layers, self.n_heads * self.head_dim)
        gauge = torch.empty(self.n_layers, 3)  # first / newest / recalled shares
        ints = ctypes.c_int * self.n_layers
        rc = native.sc_step_layers(self._m, layers, x.data_ptr(), pos, n_gauge, (ctypes.c_void_p * len(keys))(*keys),
                                   (ctypes.c_void_p * len(values))(*values), ints(*caps), ints(*ns), max(ns),
                                   out.data_ptr(), queries.data_ptr(), gauge.data_ptr())
        if rc:
            raise MemoryError("the native decode step ran out of memory") if rc == -1 else ValueError(
                f"the native decode step refused its cache slices ({rc})")
        return self._logits(out), queries, gauge

    def _slices(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: int) -> tuple[list[int], list[int]]:
        """(caps, ns) of each layer's keys / values: [1, H_kv, n, D] with unit strides in D and slots, the heads
        `cap` slots apart, both alike; all fp32 or all bf16 on the CPU."""
        if len(keys) != self.n_layers or len(values) != self.n_layers:
            raise ValueError(f"{len(keys)} key buffers for {self.n_layers} layers")
        caps, ns = [], []
        D = self.head_dim
        for k, v in zip(keys, values):
            cap = k.stride(1) // D
            if (k.shape != v.shape or k.stride() != v.stride() or k.shape[1] != self.n_kv or k.shape[3] != D
                    or k.stride()[2:] != (D, 1) or k.stride(1) % D or k.shape[2] > cap or k.dtype != keys[0].dtype
                    or v.dtype != k.dtype or k.dtype not in (torch.float32, torch.bfloat16) or k.device.type != "cpu"):
                raise ValueError(f"KV buffer {tuple(k.shape)} strides {k.stride()} {k.dtype} {k.device}: want CPU "
                                 f"[1, {self.n_kv}, n, {D}] rows, heads cap slots apart, fp32 or bf16 like the first")
            caps.append(cap)
            ns.append(pos + 1 if k.shape[2] == cap else k.shape[2])
        return caps, ns

    def _check_buffers(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """The layout the C code indexes: per layer [1, H_kv, cap, D], contiguous, CPU, all fp32 or all bf16."""
        if len(keys) != self.n_layers or len(values) != self.n_layers:
            raise ValueError(f"{len(keys)} key buffers for {self.n_layers} layers")
        want = (1, self.n_kv, keys[0].shape[2], self.head_dim)
        for b in keys + values:
            if (tuple(b.shape) != want or b.dtype != keys[0].dtype or b.dtype not in (torch.float32, torch.bfloat16)
                    or not b.is_contiguous() or b.device.type != "cpu"):
                raise ValueError(f"KV buffer {tuple(b.shape)} {b.dtype} {b.device}: want contiguous CPU {want} "
                                 f"fp32 or bf16, like the first")

    def prepare(self, kv_dtype: torch.dtype) -> None:
        """Nothing to build (the kernels compiled when the model was packed)."""

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        """Nothing to build."""

