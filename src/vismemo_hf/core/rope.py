"""Moving cached keys to a new position offset.

Shifting the text before an image by delta shifts all three M-RoPE coordinates (t, h, w)
of its tokens by delta, so every rotary channel pair j turns by delta * inv_freq[j]
whatever section it belongs to: a plain RoPE rotation. A page moved by whole visual tokens
shifts the h and w coordinates by different amounts: each pair then turns by its own
section's delta, from the (cos, sin) the model's rotary embedding gives for the delta
(``ModelAdapter.turn``). Both apply to keys that are already rotated (and scaled by
``attention_scaling``), so their own cos/sin are unscaled.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd ``keys`` (..., head_dim) by ``delta`` positions."""
    if delta == 0:
        return keys
    angle = float(delta) * inv_freq.to(device=keys.device, dtype=torch.float64)
    angle = torch.cat([angle, angle]).to(torch.float32)
    k = keys.float()
    return (k * angle.cos() + rotate_half(k) * angle.sin()).to(keys.dtype)


def turn(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd ``keys`` (..., head_dim) by the unscaled rotation (cos, sin) (head_dim,) of a position delta."""
    k = keys.float()
    return (k * cos.to(k.device) + rotate_half(k) * sin.to(k.device)).to(keys.dtype)
