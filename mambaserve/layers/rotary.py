"""Rotary position embedding (Su et al. 2021, RoFormer, section 3.4), "rotate half" layout.

Only the first `rotary_dim` features of each head rotate (Bamba rotates half of them); the
frequencies are base^(-2i / rotary_dim). cos/sin are computed from the positions of the packed
batch, so prefills, chunks and decodes need no separate paths.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Apply RoPE to q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads, head_dim)."""

    def __init__(self, head_dim: int, rotary_dim: int, base: float):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and at most head_dim ({head_dim})")
        self.rotary_dim, self.base = rotary_dim, base
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the frequencies: also called after the model is materialised from meta."""
        if self.inv_freq.is_meta:
            return
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq = 1.0 / (self.base ** (exponents / self.rotary_dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)  # (T, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, rotary_dim)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
