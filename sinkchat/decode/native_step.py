"""The native decode step: one token through every layer in one C call (`csrc/step.c: sc_step`), over the sink
cache's own K/V buffers.

Why: with the matmuls in sinkchat's VNNI kernels, what is left of a token is ~20 small operations a layer; through
torch each costs a dispatch (~5-10 us), through transformers' forward ~14 ms a token in all. In C they cost what
their arithmetic costs, and one ctypes call per token replaces dynamo's guards and inductor's build (no compiler
stack in the process: ~85 MB less RSS than the compiled step, and no 1.5-minute first build).

Same math as `fastdecode.decode_one` and transformers' forward (RMSNorm, rotate-half RoPE at the in-cache slot,
GQA softmax attention over slots <= pos, SiLU MLP), with attention in fp32 over K/V stored as the cache's dtype
(fp32 or bf16). Tests stream tiny Llama and Qwen2 models through it and through transformers and compare.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from sinkchat.model import int4
from sinkchat.kernels import native
from sinkchat.decode.torch_step import unsupported_reason
from sinkchat.model.spec import ModelSpec

log = logging.getLogger(__name__)

# the order `sc_step` reads each layer's (weights, scales, bias) triples in (csrc/step.c)
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")


def why_not(model: Any, spec: ModelSpec) -> str | None:
    """Why `NativeStep` cannot run this model (None: it can): the kernels, the spec's shape, the packed weights."""
    reason = native.why_unavailable() or spec.fast_step_refusal(native=True) or unsupported_reason(model, "native")
    if reason:
        return reason
    if getattr(model.model.norm, "weight", None) is None:
        return "final norm without weight"
    return None


class NativeStep:
    """The Engine's single-token path on the native kernels: `__call__` as `torch_step.TorchStep`'s (logits,
    pre-RoPE queries, gauge shares). Nothing to build beyond the kernels' library, so `prepare` / `warm_up` do
    nothing and the status is always "native"."""

    mode = "native"
    status = "native"
    failed = None

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        base = model.model
        layers = base.layers
        self.n_layers = spec.n_layers
        self.n_heads, self.n_kv, self.head_dim = spec.n_heads, spec.n_kv, spec.head_dim
        self.embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        table = head.table if isinstance(head, int4.Int8Head) and head.table.kernels == "native" else None
        self.head = None if table is not None else head  # e.g. an untied fp32 lm_head: applied here in torch
        self.vocab = table.num_embeddings if table is not None else spec.vocab
        # keep every tensor the struct points into alive for the step's lifetime
        self._keep: list[torch.Tensor] = [
            spec.inv_freq(0).contiguous(),
            torch.stack([layer.input_layernorm.weight.detach().float() for layer in layers]).contiguous(),
            torch.stack([layer.post_attention_layernorm.weight.detach().float() for layer in layers]).contiguous(),
            base.norm.weight.detach().float().contiguous(),
        ]
        ptrs = []
        for layer in layers:
            for name in _LINEARS:
                lin = layer.get_submodule(name)
                bias = None if lin.bias is None else lin.bias.detach().float().contiguous()  # C reads fp32
                self._keep += [lin.qw, lin.sw] + ([] if bias is None else [bias])  # what the pointers point into
                ptrs += [lin.qw.data_ptr(), lin.sw.data_ptr(), None if bias is None else bias.data_ptr()]
        if table is not None:
            self._keep += [table.hw, table.scale]
        self._lin = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._m = native.StepModel(
            n_layers=self.n_layers, dim=spec.dim, n_heads=self.n_heads, n_kv=self.n_kv,
            head_dim=self.head_dim, inter=spec.inter,
            vocab=table.hw.shape[0] * native.RG if table is not None else 0, kv_bf16=0,
            eps=spec.norm.eps, scaling=spec.layers[0].scaling, rope_scale=spec.layers[0].rope.attention_scaling,
            inv_freq=self._keep[0].data_ptr(), norm_in=self._keep[1].data_ptr(), norm_post=self._keep[2].data_ptr(),
            norm_final=self._keep[3].data_ptr(), lin=ctypes.cast(self._lin, ctypes.c_void_p),
            table=None if table is None else table.hw.data_ptr(),
            table_scale=None if table is None else table.scale.data_ptr())
        self._out = self._m.vocab if table is not None else spec.dim
        self._kv: tuple[Any, ...] = ()

    @classmethod
    def for_model(cls, model: Any, spec: ModelSpec) -> "NativeStep | None":
        reason = why_not(model, spec)
        if reason is not None:
            log.info("native decode step off: %s", reason)
            return None
        return cls(model, spec)

    def __call__(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token `tok` at slot `pos`: writes its k/v there, returns logits [1, V], queries [L, H*D], gauge [L, 2]."""
        k0 = keys[0]
        cap = k0.shape[2]
        ptrs = tuple(b.data_ptr() for b in keys + values)  # every buffer: a new cache may reuse some addresses
        key = (ptrs, cap, k0.dtype)
        if not self._kv or self._kv[0] != key:
            self._check_buffers(keys, values)
            kp = (ctypes.c_void_p * len(keys))(*ptrs[: len(keys)])
            vp = (ctypes.c_void_p * len(values))(*ptrs[len(keys) :])
            self._kv = (key, kp, vp, keys + values)  # the tensors too: their memory must outlive the pointers
            self._m.kv_bf16 = int(k0.dtype == torch.bfloat16)
        if not 0 <= pos < cap:
            raise ValueError(f"slot {pos} outside the cache (capacity {cap})")
        with torch.no_grad():
            x = self.embed(torch.tensor([tok])).float().contiguous()  # [1, C]
        out = torch.empty(self._out)
        queries = torch.empty(self.n_layers, self.n_heads * self.head_dim)
        gauge = torch.empty(self.n_layers, 2)
        if native.sc_step(self._m, x.data_ptr(), pos, n_gauge, self._kv[1], self._kv[2], cap,
                          out.data_ptr(), queries.data_ptr(), gauge.data_ptr()):
            raise MemoryError("the native decode step ran out of memory")
        if self.head is not None:
            with torch.no_grad():
                logits = self.head(out[None]).float()  # [1, V]
        else:
            logits = out[None, : self.vocab]
        return logits, queries, gauge

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

