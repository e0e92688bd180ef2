"""`--quant q4`: weight-only 4-bit linears in the GGUF Q4_1 layout, run by torch's own CPU int4 kernel.

Why not bitsandbytes NF4 for the bundled model: its weights are *already* Q4_1 (blocks of 32: w = d·q + m,
q in 0..15). NF4 has a fixed, symmetric code book and cannot hold those values, so re-quantizing them costs +16%
perplexity. An asymmetric group-32 layout (scale + zero point per block) holds them exactly: ggml's Q4_1 sets
m = min and d = (max − min)/15, so a min/max requantization recovers the same d, m and q. Only the per-block
scale and zero are rounded, to the kernel's compute dtype (bf16: ~3 significant digits).

The kernel (`aten._weight_int4pack_mm_for_cpu`, the one torchao's int4 weight-only CPU path uses) reads half a
byte per weight instead of four, which is what bounds decode speed on a CPU. Activations go in as bf16 and come
back as the model's dtype; everything outside the linears stays in fp32.

For other checkpoints (plain fp16/fp32 weights) the same min/max round-to-nearest with 32-weight groups is a
standard asymmetric 4-bit scheme (RTN, as in GPTQ/AWQ's baseline and HQQ without its optimisation step).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from sinkchat.kernels import native
log = logging.getLogger(__name__)

GROUP = 32
COMPUTE_DTYPE = torch.bfloat16
_PACK_ROWS = 64  # torch's CPU int4 pack interleaves output rows in self-contained blocks of 64 (torch_step.PACK_ROWS)


def available() -> bool:
    """The CPU int4 kernel exists in this torch build."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max round-to-nearest 4-bit: w [N, K] -> q int32 [N, K] in 0..15, scale [N, K/g], zero [N, K/g].

    The kernel dequantizes as (q − 8)·scale + zero, so zero = min + 8·scale."""
    n, k = w.shape
    wg = w.detach().to(torch.float64).reshape(n, k // group, group)  # [N, K/g, g]
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/g]
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant block: q = 0 gives lo exactly
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, lo + 8 * scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Inverse of `quantize` in fp64 (the reference the tests compare the kernel with): [N, K]."""
    n, k = q.shape
    qg = q.to(torch.float64).reshape(n, k // group, group)
    return ((qg - 8) * scale[..., None].double() + zero[..., None].double()).reshape(n, k)


def fits(lin: nn.Linear, group: int = GROUP) -> bool:
    """The kernel's shape rules: K a multiple of the group (and of 2 for packing), N a multiple of 16."""
    return lin.in_features % group == 0 and lin.out_features % 16 == 0


class Int4Linear(nn.Module):
    """A drop-in nn.Linear whose weight is packed 4-bit with a (scale, zero) pair per 32 weights.

    `kernels`: "native" keeps the weights in sinkchat's own VNNI layout (`native.pack_q4`, int8 activations),
    "torch" in torch's int4pack layout (bf16 activations); both hold the same q, scale and zero."""

    layout = "q4"

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = COMPUTE_DTYPE, kernels: str = "torch") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        self.kernels = kernels
        q, scale, zero = quantize(linear.weight.data.float())
        if kernels == "native":
            self._set_native(*native.pack_q4(q, scale, zero))
        else:
            self._set_torch(q, scale, zero)
        self._set_bias(linear.bias)

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native", compute_dtype: torch.dtype = COMPUTE_DTYPE) -> "Int4Linear":
        """Weights given as w = d·q + m (a GGUF's Q4_1 blocks): q [N, K] in 0..15, d and m fp32 [N, K/32], bias [N]
        or None. "native" stores fp16(d) and fp16(m) (each rounded once: exact for a Q4_1 file); "torch" converts
        to its (scale = d, zero = m + 8·d) convention in bf16, as `Int4Linear(linear)` does."""
        n, k = q.shape
        if n % 16 or k % GROUP or d.shape != (n, k // GROUP) or m.shape != (n, k // GROUP):
            raise ValueError(f"q4 weights {tuple(q.shape)}, d {tuple(d.shape)}, m {tuple(m.shape)}")
        if kernels == "native":
            return cls.from_tiles(*native.pack_q4_dm(q, d, m), bias, compute_dtype)
        self = cls._bare(k, n, kernels, compute_dtype)
        self._set_torch(q.to(torch.int32), d.double(), m.double() + 8 * d.double())
        self._set_bias(bias)
        return self

    @classmethod
    def from_tiles(cls, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = COMPUTE_DTYPE) -> "Int4Linear":
        """The native kernels' tiles as they are (`native.pack_q4_dm`'s, or `gguf_blocks.q4_tiles` straight from a
        Q4_1 file's bytes): qw uint8 [N/16, K/32, 4, 16, 4], sw fp16 [N/16, K/32, 2, 16]."""
        self = cls._bare(qw.shape[1] * GROUP, qw.shape[0] * 16, "native", compute_dtype)
        self._set_native(qw, sw)
        self._set_bias(bias)
        return self

    @classmethod
    def _bare(cls, k: int, n: int, kernels: str, compute_dtype: torch.dtype) -> "Int4Linear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = k, n
        self.compute_dtype, self.kernels = compute_dtype, kernels
        return self

    def _set_native(self, qw: torch.Tensor, sw: torch.Tensor) -> None:
        self.register_buffer("qw", qw)  # uint8 [N/16, K/32, 4, 16, 4]
        self.register_buffer("sw", sw)  # fp16 [N/16, K/32, 2, 16]

    def _set_torch(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))  # uint8 [N, K/2]
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scales_zeros", sz.to(self.compute_dtype))

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if isinstance(bias, nn.Parameter):
            bias = bias.data
        if bias is not None:  # the native kernel adds an fp32 bias itself
            bias = bias.detach().float().clone() if self.kernels == "native" else bias.detach().clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        lead = x.shape[:-1]
        if self.kernels == "native":
            y = native.q4_matmul(x.reshape(-1, self.in_features).float(), self.qw, self.sw, self.bias)  # [M, N]
            return y.to(x.dtype).reshape(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)  # [M, K]
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)  # [M, N]
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernel sees it, [N, K] fp32 (for tests and `probe` tools)."""
        if self.kernels == "native":  # one-hot rows quantize exactly (a block's only value is its own scale x 127)
            return self.forward(torch.eye(self.in_features)).T - (0 if self.bias is None else self.bias[:, None])
        eye = torch.eye(self.in_features, dtype=self.compute_dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).float().T

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the weight, fp32 [..., K]: an embedding lookup into a table stored as q4. Native: the
        rows' nibbles and fp16 scales unpacked directly (d·q + m, exact). Torch: torch's pack is opaque but for its
        64-row blocks, so the kernel reads back only the blocks the ids fall in (as `dequantized` does, bf16)."""
        flat = ids.reshape(-1).long()  # [n]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids outside 0..{self.out_features - 1}")
        if self.kernels == "native":
            out = native.q4_unpack(self.qw, self.sw, flat)  # [n, K]
        else:
            out = torch.empty(flat.numel(), self.in_features)
            eye = torch.eye(self.in_features, dtype=self.compute_dtype)
            for blk in torch.unique(flat // _PACK_ROWS).tolist():
                lo, hi = blk * _PACK_ROWS, min(self.out_features, (blk + 1) * _PACK_ROWS)
                sz = self.scales_zeros[:, lo:hi].contiguous()
                w = torch._weight_int4pack_mm_for_cpu(eye, self.packed[lo:hi], GROUP, sz).float().T  # [hi-lo, K]
                sel = (flat // _PACK_ROWS) == blk
                out[sel] = w[flat[sel] - lo]
        return out.reshape(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, asym int4, "
                f"{self.kernels} kernels")


def linears(root: Any, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, nn.Linear, bool]]:
    """Every nn.Linear under `root` as (name, module, packed?): the one rule for which linears become 4-bit
    (`quantize_model` swaps them; `q4load` packs the same ones straight from the file)."""
    return [(name, mod, not any(name.endswith(s) for s in skip) and fits(mod))
            for name, mod in root.named_modules() if isinstance(mod, nn.Linear)]


def quantize_model(model: Any, skip: tuple[str, ...] = ("lm_head",), kernels: str = "torch") -> tuple[int, int]:
    """Swap every fitting nn.Linear (except `skip`) for an Int4Linear; return (4-bit weights, all linear weights)."""
    total = quantized = 0
    for name, mod, pack in linears(model, skip):
        total += mod.weight.numel()
        if not pack:
            log.info("q4: keeping %s in %s", name, mod.weight.dtype)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int4Linear(mod, kernels=kernels))
        quantized += mod.weight.numel()
    return quantized, total


class Int8Table(nn.Module):
    """The tied token table in int8, one scale per row: embedding lookups and the output projection share it.

    The bundled GGUF stores this table as Q8_0 (int8, a scale per 32); per-row int8 is the layout torch's CPU kernel
    (`aten._weight_int8pack_mm`) runs, 4x smaller than fp32, so the 49k x 576 output projection reads 28 MB per
    token instead of 113 MB. Rows round to within half a step of rowmax/127."""

    def __init__(self, weight: Any, compute_dtype: torch.dtype = COMPUTE_DTYPE,
                 out_dtype: torch.dtype = torch.float32, kernels: str = "torch") -> None:
        """`weight`: a [V, D] tensor, or anything with `.shape` whose row slices give tensors (a file reader), so
        the fp32 table never has to be in memory whole. `out_dtype`: what embedding lookups return (the model's
        dtype). `kernels`: "native" keeps one copy in the VNNI kernel's layout (`native.pack_q8`), "torch" in
        torch's (`_weight_int8pack_mm`)."""
        super().__init__()
        n, d = weight.shape
        self.kernels = kernels = kernels if d % GROUP == 0 else "torch"  # the VNNI kernel quantizes x per 32
        if kernels == "native":  # only the kernel's layout: one copy of the table, rows padded to a multiple of 16
            rows = n + (-n) % native.RG
            table = torch.empty((rows // native.RG, d // 4, native.RG, 4), dtype=torch.uint8)  # [Vpad/16, D/4, 16, 4]
        else:
            rows, table = n, torch.empty((n, d), dtype=torch.int8)  # [V, D]
        scale = torch.zeros(rows)  # fp32, 0 on padding rows
        for i in range(0, n, 4096):  # in row blocks: whole-table temporaries would cost 3 x 113 MB of RSS
            blk = weight[i : i + 4096].detach().float()  # [b, D]
            s = (blk.abs().amax(1) / 127).clamp(min=1e-12)  # [b]
            qb = torch.round(blk / s[:, None]).clamp(-127, 127).to(torch.int8)
            if kernels == "native":
                table[i // native.RG : (i + len(qb) + native.RG - 1) // native.RG] = native.pack_q8(qb)
            else:
                table[i : i + len(qb)] = qb
            scale[i : i + len(s)] = s
        self.register_buffer("hw" if kernels == "native" else "q", table)
        self.register_buffer("scale", scale)  # for lookups (and the native kernel)
        if kernels != "native":
            self.register_buffer("scale_c", scale.to(compute_dtype))  # for torch's kernel
        self.compute_dtype, self.out_dtype = compute_dtype, out_dtype
        self.num_embeddings, self.embedding_dim = n, d

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., D] in out_dtype
        if self.kernels == "native":
            return (native.q8_rows(self.hw, ids).float() * self.scale[ids][..., None]).to(self.out_dtype)
        return (self.q[ids].float() * self.scale[ids][..., None]).to(self.out_dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # x [..., D] -> logits [..., V] in x's dtype
        lead = x.shape[:-1]
        if self.kernels == "native":
            y = native.q8_matmul(x.reshape(-1, self.embedding_dim).float(), self.hw, self.scale)
            return y[:, : self.num_embeddings].to(x.dtype).reshape(*lead, self.num_embeddings)
        y = torch._weight_int8pack_mm(x.reshape(-1, self.embedding_dim).to(self.compute_dtype), self.q, self.scale_c)
        return y.to(x.dtype).reshape(*lead, self.num_embeddings)


def embed_scale(emb: nn.Module) -> float:
    """The factor a model's own embedding multiplies its rows by (Gemma's ScaledWordEmbedding: sqrt(hidden), held
    as an fp32 tensor, so rounded to fp32 here too); 1.0 for a plain nn.Embedding. A packed table that replaces
    the embedding must keep it: without it Gemma's residual stream starts ~45x (2B: sqrt(2304)) too small."""
    return float(torch.tensor(float(getattr(emb, "scalar_embed_scale", 1.0)), dtype=torch.float32))


class Int8Embedding(nn.Module):
    def __init__(self, table: Int8Table, padding_idx: int | None = None, scale: float = 1.0) -> None:
        super().__init__()
        self.table = table
        self.padding_idx, self.scale = padding_idx, scale
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.lookup(ids)
        return out if self.scale == 1.0 else out * self.scale


class Int8Head(nn.Module):
    def __init__(self, table: Int8Table) -> None:
        super().__init__()
        self.table = table
        self.in_features, self.out_features = table.embedding_dim, table.num_embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table.project(x)


def quantize_tied_table(model: Any, kernels: str = "torch") -> bool:
    """Replace a tied embedding + lm_head pair by one Int8Table; False (nothing changed) when they are not tied."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    if emb.weight.data_ptr() != head.weight.data_ptr() or emb.weight.shape[1] % 16:
        return False
    install_table(model, Int8Table(emb.weight.data, out_dtype=emb.weight.dtype, kernels=kernels), emb.padding_idx)
    return True


def install_table(model: Any, table: Int8Table, padding_idx: int | None) -> None:
    model.set_input_embeddings(Int8Embedding(table, padding_idx, embed_scale(model.get_input_embeddings())))
    model.set_output_embeddings(Int8Head(table))
