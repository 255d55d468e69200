"""Partial rotary embedding (Qwen3.5: the first 25% of each head's dims rotate, rotate-half style).

Text-only Qwen3.5 uses interleaved M-RoPE with equal temporal/height/width positions, which is
exactly this plain RoPE over the rotary dims. The module holds the frequencies; the rotation itself
is ``bole.ops.rope`` (``rope_cos_sin``, ``apply_rope``), applied fused with the q / k norms by the
attention prologue (``qk_norm_rope_store``: the twin or kernels.qk_norm_rope, chosen by the backend).
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
        """[rotary_dim / 2] fp32: theta^(-2j / rotary_dim), cached per device."""
        device = torch.device(device)
        if device not in self._inv_freq:
            r = self.rotary_dim
            inv = 1.0 / (self.theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
            self._inv_freq[device] = inv.to(device)
        return self._inv_freq[device]
