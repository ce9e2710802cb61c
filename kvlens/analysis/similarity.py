"""Cosine similarity of prefill states: token x token maps, adjacent tokens, the k tokens before t.

- `similarity_map`: KVMerger Fig. 2 (keys) and CORM Fig. 3 (queries): `cos(x_i, x_j)` for one
  (layer, head), block-averaged to at most `max_size` x `max_size` cells for long prompts.
- `adjacency`: KVMerger Fig. 3a's locality, summarised: mean over t of `cos(x_t, x_{t-1})` per
  layer and head.
- `preceding_similarity`: KVMerger Fig. 3a itself: `cos(x_t, x_{t-j})` for j = 1..k, per head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlens.analysis.states import head_states, kind_code, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.runs.run import Run

NAMES = {"q": "query", "k": "key", "v": "value"}


@dataclass
class SimilarityMap:
    """`matrix` `(n, n)`: mean cosine similarity between the tokens of block i and block j.

    `edges` `(n + 1,)` are the token boundaries of the blocks (block i = tokens
    `edges[i]:edges[i+1]`); `block` is the largest block size (1 = no averaging). With `lower`,
    cells above the diagonal are NaN (the papers show each token against those before it).
    """

    kind: str
    layer: int
    head: int
    matrix: torch.Tensor
    edges: torch.Tensor
    tokens: int
    lower: bool

    @property
    def block(self) -> int:
        return int((self.edges[1:] - self.edges[:-1]).max())


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length `(..., T, D)`; zero rows stay zero."""
    return torch.nn.functional.normalize(x.float(), dim=-1)


def block_edges(t: int, max_size: int) -> torch.Tensor:
    """Boundaries of `ceil(t / ceil(t / max_size))` nearly equal consecutive blocks `(n + 1,)`."""
    if max_size < 1:
        raise KvlensError(f"max_size must be at least 1; got {max_size}.")
    n = math.ceil(t / math.ceil(t / max_size))
    return torch.div(torch.arange(n + 1) * t, n, rounding_mode="floor")


def similarity_map(run: Run, layer: int, head: int, kind: str = "key", max_size: int = 512,
                   lower: bool = True) -> SimilarityMap:
    """Token x token cosine similarity of one head's prefill states, averaged over blocks.

    The mean of `cos(x_i, x_j)` over i in block a and j in block b equals `m_a . m_b` with `m_a`
    the mean of the block's unit vectors, so long prompts never build the T x T map. The
    block-size-weighted mean of the result equals the mean of the full map.
    """
    x = unit(head_states(run, kind, layer, head))  # (T, D)
    t = x.shape[0]
    edges = block_edges(t, max_size)
    sizes = (edges[1:] - edges[:-1]).tolist()
    means = torch.stack([blk.mean(0) for blk in torch.split(x, sizes)])  # (n, D)
    matrix = means @ means.T  # (n, n)
    if lower:
        matrix = matrix.masked_fill(torch.ones_like(matrix, dtype=torch.bool).triu(1), float("nan"))
    return SimilarityMap(NAMES[kind_code(kind)], layer, head, matrix, edges, t, lower)


@dataclass
class Adjacency:
    """`values[kind]` `(L, H)`: mean over t >= 1 of `cos(x_t, x_{t-1})` for each recorded layer and head."""

    layers: list[int]
    values: dict[str, torch.Tensor]

    def per_layer(self, kind: str) -> list[float]:
        """Mean over the layer's heads, per layer (the CLI's JSON contract)."""
        return self.values[kind].mean(1).tolist()


def adjacency(run: Run) -> Adjacency:
    """Adjacent-token cosine similarity of queries, keys and values per layer and head (KVMerger Fig. 3a)."""
    layers = recorded_layers(run)
    values = {}
    for code, name in NAMES.items():
        rows = []
        for layer in layers:
            x = unit(states(run, code, layer))  # (H, T, D)
            if x.shape[1] < 2:
                raise KvlensError("Adjacent-token similarity needs a prompt of at least 2 tokens.")
            rows.append((x[:, 1:] * x[:, :-1]).sum(-1).mean(-1))  # (H,)
        values[name] = torch.stack(rows)  # (L, H)
    return Adjacency(layers, values)


def preceding_similarity(run: Run, layer: int, token: int, window: int = 32, kind: str = "key") -> torch.Tensor:
    """`cos(x_token, x_{token-j})` for j = 1..window and every head: `(H, window)`, NaN before token 0.

    KVMerger Fig. 3a plots this for tokens 2000, 3000 and 4000 of a long prompt.
    """
    x = unit(states(run, kind, layer))  # (H, T, D)
    if not 0 <= token < x.shape[1]:
        raise KvlensError(f"Token {token} is out of range: the prompt has tokens 0 to {x.shape[1] - 1}.")
    if window < 1:
        raise KvlensError(f"The window must be at least 1 token; got {window}.")
    out = torch.full((x.shape[0], window), float("nan"))
    n = min(window, token)
    before = x[:, token - n:token].flip(1)  # (H, n, D), nearest first
    out[:, :n] = (before * x[:, token:token + 1]).sum(-1)
    return out
