"""The layers every model family shares: rotary position tables and the mask of real positions.

The SALM (``train.models.salm``) and each pretrained encoder family (``train.models.hf_encoder``)
build on these, so that no family imports another.
"""

from __future__ import annotations

import torch


def inverse_frequencies(dim: int, theta: float, device) -> torch.Tensor:
    """The (dim/2,) fp32 frequencies of sinusoidal position tables of width ``dim``."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, ...]:
    """cos and sin (seq_len, head_dim/2) for rotary embeddings, always in fp32."""
    inv_freq = inverse_frequencies(head_dim, theta, device)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of ``x`` (B, T, heads, head_dim)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def length_mask(lens: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len, device=lens.device)[None, :] < lens[:, None]
