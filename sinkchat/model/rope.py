"""Rotary position embedding math for the cache: rotating keys by a shift of positions (re-rotation on eviction)
and queries to their in-cache slot (the gauge). Built from `ModelSpec.rope(layer)`, never from the model.

fp32 math with cos/sin computed in fp64, so a shift by -n is the exact inverse of +n to fp32 precision; tests check
rotations against an fp64 reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rope:
    """What re-rotation needs: fp32 inverse frequencies [rot_dim/2]; rot_dim < head_dim means partial rotary."""

    inv_freq: torch.Tensor  # [rot_dim // 2], fp32
    head_dim: int
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, shift: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the angle shift*inv_freq, computed in fp64 so large shifts stay exact to fp32 precision.
        Memoised: an eviction asks once per layer for the same shift."""
        key = (shift, str(device))
        hit = self._memo.get(key)
        if hit is None:
            ang = float(shift) * self.inv_freq.to(torch.float64)  # [R/2]
            ang = torch.cat([ang, ang])  # [R], rotate_half layout
            if len(self._memo) > 64:
                self._memo.clear()
            hit = self._memo[key] = (ang.cos().to(device=device, dtype=torch.float32).contiguous(),
                                     ang.sin().to(device=device, dtype=torch.float32).contiguous())
        return hit

    def rotate_into(self, k: torch.Tensor, shift: int, out: torch.Tensor) -> torch.Tensor:
        """`out` = `k` rotated by `shift`, for fp32 k [B, H, T, D], without the temporaries of `rotate`: an eviction
        re-rotates the whole cache (90 MB at cache 2048), so each pass over it is a visible pause. `out` must not
        overlap `k`. The angle is the same for every position, so cos/sin are one [R/2] vector each."""
        cos, sin = self.cos_sin(shift, k.device)
        half, r = self.rot_dim // 2, self.rot_dim
        c, s = cos[:half], sin[:half]  # the two halves of the rotate_half layout carry the same angles
        k1, k2 = k[..., :half], k[..., half:r]
        o1, o2 = out[..., :half], out[..., half:r]
        torch.mul(k1, c, out=o1)
        o1.addcmul_(k2, s, value=-1.0)  # x1 cos - x2 sin
        torch.mul(k2, c, out=o2)
        o2.addcmul_(k1, s)  # x2 cos + x1 sin
        if r < k.shape[-1]:
            out[..., r:].copy_(k[..., r:])
        return out

    def rotate(self, k: torch.Tensor, shift: int) -> torch.Tensor:
        """Rotate keys k [B, H, T, D] from position p to p + shift (shift may be negative); math in fp32."""
        k32 = k.float()  # a copy unless k is fp32 already; rotate_into must not write over its input
        return self.rotate_into(k32, shift, torch.empty_like(k32)).to(k.dtype)
