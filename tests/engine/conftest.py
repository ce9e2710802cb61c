"""Helpers the engine's low-rank storage tests share."""

from __future__ import annotations

import torch

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 4


def keys_like(n: int, seed: int = 0) -> torch.Tensor:
    """Keys of 3 KV heads, `(3, n, 16)`, with a decaying spectrum."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, 16, generator=g) * torch.linspace(4, 0.1, 16)
