"""Native prefill: a chunk of T tokens through every layer in one C call (`csrc/prefill.c: sc_prefill`), on the
native decode step's model (its `Model` struct, packed weights and KV buffers), beside that step.

Why: for `summarize` and `ppl` the prefill is the workload. Through transformers' forward each packed linear
quantizes its input again (q, k and v: three times the same rows), ~20 torch ops a layer run from Python, and a bf16
cache is converted to fp32 whole for every layer's attention. In C the chunk costs its matmuls plus a causal
attention over cache + chunk; measured figures in the README ("Decoding").

Same math as `sc_step` on each row (RMSNorm, q/k/v on int8 activations, q/k norms, RoPE at the row's in-cache slot,
the k/v rows written into the cache as fp32 or bf16, softmax attention over the slots up to the row's own, SiLU MLP),
so it runs what the native step runs: Llama, Mistral, Qwen2, Qwen3, Phi-3 shapes, any of the four weight layouts.
Anything else the step may learn later (Gemma's soft-capping, sandwich norms, local layers) is refused here by the
spec, and the Engine keeps transformers' forward for chunks. `SINKCHAT_PREFILL=hf` turns it off (for measurements:
the old path on the same process setup); tests/test_native_prefill.py holds it to transformers' forward.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from sinkchat.config import prefill_mode
from sinkchat.kernels import native
from sinkchat.model.spec import ModelSpec

log = logging.getLogger(__name__)

# What csrc/prefill.c computes: the native step's model types as of ABI 5 (a type the step learns later stays on
# transformers' forward for chunks until prefill.c learns it too).
PREFILL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def refusal(spec: ModelSpec) -> str | None:
    """Why sc_prefill cannot run a model of this spec (None: it can), beyond what the native step checks."""
    if prefill_mode() == "hf":
        return "SINKCHAT_PREFILL=hf"
    if spec.model_type not in PREFILL_TYPES:
        return f"model type {spec.model_type!r} (native prefill: {', '.join(PREFILL_TYPES)})"
    if spec.act != "silu" or spec.norm.sandwich or spec.norm.unit_offset or spec.embed_scale != 1.0:
        return "activation, norm or embedding variant"
    if spec.attn_softcap or spec.final_softcap or spec.sliding_window_bites() or spec.hybrid:
        return "attention variant"
    if len({layer.rope for layer in spec.layers}) > 1 or len({layer.scaling for layer in spec.layers}) > 1:
        return "a RoPE or scale per layer"
    return None


class NativePrefill:
    """`__call__(ids, pos, keys, values, all_logits)`: logits [T or 1, V] of tokens `ids` at in-cache slots
    pos..pos+T-1, their k/v written into the buffers (the caller has made room and counts the slots)."""

    def __init__(self, step: Any) -> None:
        self.step = step  # the NativeStep whose model struct, embedding, head and buffer pointers this shares

    @classmethod
    def for_step(cls, step: Any, spec: ModelSpec) -> "NativePrefill | None":
        reason = refusal(spec)
        if reason is not None:
            log.info("native prefill off: %s", reason)
            return None
        return cls(step)

    def __call__(self, ids: list[int], pos: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                 all_logits: bool = False, base: int = 0, used: int = 0, queries: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """`base`: slots in front of the stream in every buffer (the recall memory's region), of which the last
        `used` hold recalled keys the chunk attends to (stream slot i is buffer slot base + i; RoPE position i).
        `queries` (fp32 [L, H*D], or None): gets the last row's pre-RoPE queries."""
        step, t = self.step, len(ids)
        cap = keys[0].shape[2]
        if t < 1 or pos < 0 or not 0 <= used <= base or base + pos + t > cap:
            raise ValueError(f"slots [{pos}, {pos + t}) outside the cache (capacity {cap - base})")
        kp, vp = step._pointers(keys, values)  # also says (kv_bf16) what these buffers hold
        if base - used:  # every layer's buffer from its first attended slot on (the heads stay cap slots apart)
            skip = (base - used) * step.head_dim * keys[0].element_size()
            kp = (ctypes.c_void_p * len(keys))(*[b.data_ptr() + skip for b in keys])
            vp = (ctypes.c_void_p * len(values))(*[b.data_ptr() + skip for b in values])
        m = step._m
        with torch.no_grad():
            x = step.embed(torch.tensor(ids)).float().contiguous()  # [T, C]
        n_out = t if all_logits else 1
        out = torch.empty(n_out, step._out)
        q_ptr = None
        if queries is not None:
            if queries.shape != (step.n_layers, step.n_heads * step.head_dim) or queries.dtype != torch.float32 \
                    or not queries.is_contiguous():
                raise ValueError(f"queries {tuple(queries.shape)} {queries.dtype}: want fp32 [L, H*D]")
            q_ptr = queries.data_ptr()
        rc = native.sc_prefill(m, x.data_ptr(), t, pos, n_out, kp, vp, cap, out.data_ptr(), used, q_ptr)
        if rc == -1:
            raise MemoryError("the native prefill ran out of memory")
        if rc:
            raise RuntimeError(f"the native prefill failed ({rc})")
        if step.head is not None:
            with torch.no_grad():
                return step.head(out).float()  # [n_out, V]
        return out[:, : step.vocab]
