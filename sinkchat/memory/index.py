"""The recall memory's index: per block, layer and KV head a few representative keys, in one growing buffer.

Layout [M * H_kv, blocks * r, D]: one batch per (layer, KV head), a block's r keys appended along the middle axis,
so scoring every block is one batched matrix-vector product over contiguous rows (`scores`). Stored as
[blocks, M, H_kv, r, D] and scored by einsum, the permute it needed copied the whole index at every choice (15 ms
at 300 blocks in bf16). Room to grow (capacity doubling) and a moving front: blocks arrive one at a time and the
budget removes the oldest, so appending by `torch.cat` would copy the whole index at every block.

Scoring (`scores`): rule "mass" (the default) takes one query column per query head and turns each head's best dots
into its share among the blocks (a softmax at the layer's attention scale) before summing heads, so a head that
singles out one block is not outvoted by heads whose dots are merely large: Retrieve.Number at 4k tokens 8/10
against 6/10 for the plain sum of group-summed dots (rule "far"), the needle's block chosen in a median of 29
layers of 30 against 28.5 (docs/memory.md "Choosing blocks").
"""

from __future__ import annotations

import torch

from sinkchat.memory import native

PER_BATCH_ROWS = 512  # live rows a batch (128 blocks of 4) from which bf16 scoring goes a batch at a time
#                       (`_batched`); below, the one batched call is faster (50 blocks: 0.5 ms against 2.5 ms)


class Index:
    """The rows of the blocks `ids` (oldest first), `r` rows a block in every (layer, KV head) batch: representative
    keys (W = D) or one row of bounds [max | min] (W = 2D)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None  # [M * H_kv, capacity * r, D]
        self.lo = self.hi = 0  # blocks [lo, hi) of the buffer are live
        self.r = 0
        self.shape: tuple[int, ...] = ()
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (what RSS sees)."""
        return 0 if self.buf is None else self.buf.nbytes

    def add(self, bid: int, reps: torch.Tensor) -> None:
        """Append block `bid`'s rows [M, H_kv, r, W]."""
        m, h, r, d = reps.shape
        n = self.hi - self.lo
        other = self.buf is None or self.shape != tuple(reps.shape) or self.buf.dtype != reps.dtype
        if other and self.ids:  # rows of another rule or dtype would be scored as if they were these
            raise ValueError(f"index rows {tuple(reps.shape)} {reps.dtype} added to an index of {self.shape}")
        if other:
            self.buf, self.lo, self.hi, n, self.r, self.shape = reps.new_empty(m * h, 16 * r, d), 0, 0, 0, r, tuple(
                reps.shape)
        elif self.hi * r == self.buf.shape[1]:  # full: compact to the front, doubling when more than half is live
            size = self.buf.shape[1] * (2 if n * r > self.buf.shape[1] // 2 else 1)
            new = reps.new_empty(m * h, size, d)
            new[:, : n * r] = self.buf[:, self.lo * r : self.hi * r]
            self.buf, self.lo, self.hi = new, 0, n
        self.buf[:, self.hi * r : (self.hi + 1) * r] = reps.reshape(m * h, r, d)
        self.hi += 1
        self.ids.append(bid)

    def remove(self, bid: int) -> None:
        """Drop block `bid` (the oldest: the front moves; any other: the blocks after it move up)."""
        if bid not in self.ids:
            return
        row, r = self.ids.index(bid), self.r
        if row and self.buf is not None:
            at = (self.lo + row) * r
            self.buf[:, at : (self.hi - 1) * r] = self.buf[:, at + r : self.hi * r].clone()
            self.hi -= 1
        else:
            self.lo += 1
        self.ids.pop(row)
        if not self.ids:
            self.lo = self.hi = 0

    def scores(self, q: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """[NB, M]: per block and layer, summed over KV heads and query columns, the best row's dot with the
        queries q [M, H_kv, W] (one column: rule "far", the head group's queries summed) or q [M, H_kv, W, G] (one
        column per query head). With `scale` [M] (rule "mass") each column's best dots, times the layer's softmax
        scale, go through a softmax over the blocks first: a block's share of each head's attention among the
        blocks, so every head has the same say. Computed in q's dtype (fp64 queries: fp64, else the index's; what
        follows the dots in fp32)."""
        assert self.buf is not None
        m, h, r, d = self.shape
        q = q[..., None] if q.dim() == 3 else q  # [M, H_kv, W, G]
        g = q.shape[-1]
        rows = self.buf[:, self.lo * r : self.hi * r]  # [M*H_kv, NB*r, W]
        dt = torch.float64 if q.dtype == torch.float64 else rows.dtype
        qs = q.reshape(m * h, d, g).to(dt)
        per_batch = dt == torch.bfloat16 and rows.shape[1] >= PER_BATCH_ROWS and not rows.is_contiguous()
        out = torch.float64 if dt == torch.float64 else torch.float32
        # rule "mass" past PER_BATCH_ROWS: each block's best dot straight from C (`native.dots`: `_batched`'s bf16
        # dots, their max over the block's r rows, in fp32); the max may differ from amax's only in a zero's sign,
        # which the softmax below maps to the same bits (exp(+-0 - m) alike). 1,550 blocks: 15 ms of CPU (35 before
        # the C dots took eight rows at once) against 112-124 ms through `_batched` (native.py)
        best = native.dots(rows, qs.transpose(1, 2).contiguous(), r) if per_batch and g > 1 and scale is not None \
            else None
        if best is not None:
            best = best.view(m, h, -1, g)  # [M, H_kv, NB, G]
        else:
            dots = _batched(rows, qs) if per_batch else torch.matmul(rows.to(dt), qs)  # [M*H_kv, NB*r, G]
            if g == 1 and scale is None:  # rule "far": the one column
                best = dots.view(m, h, -1, r).amax(-1)  # [M, H_kv, NB]
                return best.to(out).sum(1).T  # [NB, M]
            best = dots.reshape(m, h, -1, r, g).amax(3).to(out)  # [M, H_kv, NB, G]
        if scale is not None:
            best = torch.softmax(best * scale.to(out)[:, None, None, None], dim=2)
        return best.sum((1, 3)).T  # [NB, M]

    def clear(self) -> None:
        self.buf, self.lo, self.hi, self.ids = None, 0, 0, []


def _batched(rows: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """torch.matmul(rows, qs) of bf16 rows [B, N, W] (a slice of the growing buffer) and qs [B, W, G], one matmul a
    batch. Why: the live rows are contiguous within each batch but not across batches (the buffer has room to
    grow), and torch's batched matmul copied the whole slice first: scoring 1,550 blocks (100k tokens) took ~380
    ms on a busy core against ~60 ms a batch at a time (190 blocks: 28 against 3.4 ms). One column: bit-identical
    to the batched call for bf16 (60 random shapes, 1 and 2 threads; tests/test_memory_cost.py). Several columns,
    [G, W] x [W, N]: torch sums each dot in another order than the batched [N, W] x [W, G] (64 partial sums and a
    halving tree against 4 partials, native.py), so a few dots differ in their last bf16 bit (~5 in 100k random
    ones, a third of tests/test_memory_native.py's probe); this is what rule "mass" has run past PER_BATCH_ROWS.
    fp32 and fp64 keep the batched call, whose kernel there differs from the per-batch one in its last bits."""
    if qs.shape[-1] > 1:  # several query columns (rule "mass"): [G, W] x [W, N] a batch, faster than [N, W] x
        qt = qs.transpose(1, 2).contiguous()  # [W, G] here (1,550 blocks, 3 columns: ~97 ms against ~155, busy)
        fast = native.dots(rows, qt)  # the same dots in C where they agree (native.py), ~3.5x less CPU
        if fast is not None:
            return fast  # [B, N, G]
        outt = rows.new_empty(rows.shape[0], qs.shape[-1], rows.shape[1])  # [B, G, N]
        for i in range(rows.shape[0]):
            torch.matmul(qt[i], rows[i].T, out=outt[i])
        return outt.transpose(1, 2)
    out = rows.new_empty(rows.shape[0], rows.shape[1], 1)
    for i in range(rows.shape[0]):
        torch.matmul(rows[i], qs[i], out=out[i])
    return out
