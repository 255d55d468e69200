"""Partial rotary embedding (Qwen3.5: the first 25% of each head's dims rotate, rotate-half style).

Text-only Qwen3.5 uses interleaved M-RoPE with equal temporal/height/width positions, which is
exactly this plain RoPE over the rotary dims.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # no buffer: models are built on "meta"

    def inv_freq(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._inv_freq:
            r = self.rotary_dim
            inv = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
            self._inv_freq[device] = inv.to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rotary_dim] (fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim]; rotates the first rotary_dim dims, passes the rest through."""
        r = cos.shape[-1]
        x_rot, x_pass = x[..., :r], x[..., r:]
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
        rotated = torch.cat([-x2, x1], dim=-1)
        return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
