"""The recall memory's faster paths give the bits of the plain ones they replace (docs/memory.md, "Cost"): a block
record built in one buffer, keys rotated in place, the bf16 index scored a batch at a time."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from sinkchat.memory.blocks import CODES, HEADER, MAGIC, VERSION, Block, cos_sin, rotate
from sinkchat.memory.index import PER_BATCH_ROWS, Index


def _record(b: Block) -> bytes:
    """A 16-bit record as the plain code wrote it: each layer's bytes joined, then the header and payload."""
    def raw(t: torch.Tensor) -> bytes:
        t = t.contiguous()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()

    m, h, n, d = b.keys.shape
    chunks = [raw(b.keys[i]) + raw(b.values[i]) for i in range(m)]
    table = struct.pack(f"<{m}I", *[zlib.crc32(c) for c in chunks])
    meta = table + b.abs_index.astype("<i8").tobytes() + b.ids.astype("<i4").tobytes() + \
        b.slots.astype("<i4").tobytes()
    payload = meta + b"".join(chunks)
    return HEADER.pack(MAGIC, VERSION, n, m, h, d, CODES[b.keys.dtype], b.id, len(payload), zlib.crc32(meta)) + payload


def _rotated(k: torch.Tensor, inv_freq: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Keys rotated as the plain code did: a clone, each half assigned from its two products."""
    k = k if k.dtype == torch.float64 else k.float()
    cos, sin = cos_sin(inv_freq, shifts, k.dtype)
    r, half = cos.shape[-1], cos.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:r]
    out = k.clone()
    out[..., :half] = x1 * cos[:, :half] - x2 * sin[:, :half]
    out[..., half:r] = x2 * cos[:, half:] + x1 * sin[:, half:]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 2, 16, 8), (30, 3, 64, 64), (1, 1, 5, 4)])
def test_a_record_built_in_one_buffer_has_the_joined_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[0])
    k, v = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    n = shape[2]
    blk = Block(7, np.arange(n, dtype=np.int64) + 1000, np.arange(n, dtype=np.int32) * 3, np.full(n, 4, np.int32),
                k, v)
    rec = blk.encode(16)
    assert bytes(rec) == _record(blk)
    back = Block.decode(bytes(rec[: HEADER.size]), bytes(rec[HEADER.size :]))
    assert torch.equal(back.keys, k) and torch.equal(back.values, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape,rot", [((30, 3, 64, 64), 64), ((2, 5, 8), 8), ((3, 2, 16, 16), 8)])
def test_keys_rotated_in_place_have_the_plain_bits(dtype: torch.dtype, shape: tuple[int, ...], rot: int) -> None:
    g = torch.Generator().manual_seed(shape[-1] + rot)
    k = (torch.randn(*shape, generator=g) * 4).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    shifts = torch.randint(-5000, 5000, (shape[-2],), generator=g)
    got, want = rotate(k, inv, shifts), _rotated(k, inv, shifts)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_bf16_index_scored_a_batch_at_a_time_has_the_batched_bits(threads: int) -> None:
    """The buffer's live rows (a slice: room to grow, a moving front), scored per batch, against one batched
    matmul of the same slice: 30 random sizes (both paths: below and past PER_BATCH_ROWS), including blocks removed
    from the front and the middle."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g, per_batch = torch.Generator().manual_seed(threads), 0
        for trial in range(30):
            idx, m, h, r, d = Index(), 3, 2, 4, 64
            nb = [1, 2, 5, 17, 140][trial] if trial < 5 else int(torch.randint(1, 400, (1,), generator=g))
            for b in range(nb):
                idx.add(b, (torch.randn(m, h, r, d, generator=g) * 3).bfloat16())
            for b in range(0, nb - 1, 7):
                idx.remove(b)
            q = torch.randn(m, h, d, generator=g) * 5
            rows = idx.buf[:, idx.lo * r : idx.hi * r]
            per_batch += rows.shape[1] >= PER_BATCH_ROWS and not rows.is_contiguous()
            dots = torch.matmul(rows, q.reshape(m * h, d, 1).bfloat16())
            want = dots.view(m, h, -1, r).amax(-1).float().sum(1).T
            assert torch.equal(idx.scores(q), want)
        assert per_batch >= 10  # the per-batch path itself was held to the batched bits
    finally:
        torch.set_num_threads(old)


def test_bf16_dots_a_batch_at_a_time_equal_the_batched_matmul() -> None:
    """The dots themselves, at a 100k-token index's size (90 batches of 6,200 rows, a slice of a larger buffer):
    rounding them from an fp32 product instead differs in a few of these 558k values, so this tells kernels
    apart where the scores' max and sum above may not."""
    from sinkchat.memory.index import _batched

    g = torch.Generator().manual_seed(5)
    buf = torch.randn(90, 6400, 64, generator=g).bfloat16()
    rows, qs = buf[:, 100:6300], torch.randn(90, 64, 1, generator=g).bfloat16()
    assert torch.equal(_batched(rows, qs), torch.matmul(rows, qs))


def test_the_bf16_index_with_several_query_columns_scores_a_batch_at_a_time_like_the_plain_formula() -> None:
    """Rule "mass" (one column per query head, a softmax over the blocks): past PER_BATCH_ROWS the bf16 dots are
    taken as [G, W] x [W, N] a batch (`_batched`); its scores agree with the plain formula over an fp32 product of the
    same bf16 rows, its dots rounded to bf16 as the index's are (and with the one batched call below the threshold),
    through removals at the front."""
    g = torch.Generator().manual_seed(3)
    m, h, r, d, grp = 3, 2, 4, 64, 3
    scale = torch.full((m,), 0.125)
    for nb in (20, 300):
        idx = Index()
        for b in range(nb):
            idx.add(b, (torch.randn(m, h, r, d, generator=g) * 3).bfloat16())
        for b in range(0, 30, 3):
            idx.remove(b)
        q = torch.randn(m, h, d, grp, generator=g) * 5
        rows = idx.buf[:, idx.lo * r : idx.hi * r].float()  # [M*H, NB*r, D]
        qb = q.reshape(m * h, d, grp).bfloat16().float()
        best = torch.matmul(rows, qb).bfloat16().float().view(m, h, -1, r, grp).amax(3)  # [M, H, NB, G], bf16 dots
        want = torch.softmax(best * 0.125, dim=2).sum((1, 3)).T
        torch.testing.assert_close(idx.scores(q, scale), want, rtol=2e-2, atol=2e-3)
        assert (idx.hi - idx.lo) * r >= PER_BATCH_ROWS or nb == 20
