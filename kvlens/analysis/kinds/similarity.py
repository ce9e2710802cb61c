"""Token x token cosine similarity of one head's prefill states (KVMerger Fig. 2 for keys, CORM Fig. 3 for
queries).

`cos(x_i, x_j)` of the head's states `(T, D)` for one (layer, head), block-averaged to at most
`max_size` x `max_size` cells for long prompts (`SimilarityMap.matrix` `(n, n)`). The figure takes
one state or several (e.g. keys and values: panels on one colour scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlens.analysis.registry import LAYER, Analysis, Param, nan_to_none, register_analysis
from kvlens.analysis.states import head_states, kind_name, layer_or_middle, parse_states, unit
from kvlens.errors import KvlensError
from kvlens.figures.plots import PLURAL, SCALE, WIDTH, finish, run_model
from kvlens.figures.wording import when
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


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


def block_edges(t: int, max_size: int) -> torch.Tensor:
    """Boundaries of `ceil(t / ceil(t / max_size))` nearly equal consecutive blocks `(n + 1,)`."""
    if max_size < 1:
        raise KvlensError(f"max_size must be at least 1; got {max_size}.")
    n = math.ceil(t / math.ceil(t / max_size))
    return torch.div(torch.arange(n + 1) * t, n, rounding_mode="floor")


def similarity_map(
    run: Run, layer: int, head: int, kind: str = "key", max_size: int = 512, lower: bool = True
) -> SimilarityMap:
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
    return SimilarityMap(kind_name(kind), layer, head, matrix, edges, t, lower)


def similarity_figure(
    run: Run, layer: int, head: int, kind: str | list[str] = "key", max_size: int = 512
) -> go.Figure:
    """Token x token cosine-similarity heatmap(s) of one head; several kinds share one colour scale.

    With queries among several kinds, `head` is a query head and keys/values come from its KV
    head (`head // group` under GQA); otherwise it is a KV head.
    """
    kinds = [kind] if isinstance(kind, str) else list(kind)
    group = run.shape["heads"] // run.shape["kv_heads"]
    mixed = "query" in kinds and len(kinds) > 1
    maps = [
        similarity_map(run, layer, head // group if mixed and k != "query" else head, k, max_size)
        for k in kinds
    ]
    fig = make_subplots(
        rows=1, cols=len(maps), subplot_titles=[PLURAL[m.kind] for m in maps], horizontal_spacing=0.1
    )
    lo = min(float(m.matrix.nan_to_num(1.0).min()) for m in maps)
    for i, m in enumerate(maps, start=1):
        starts = m.edges[:-1].tolist()
        fig.add_trace(
            go.Heatmap(
                z=m.matrix.tolist(),
                x=starts,
                y=starts,
                zmin=lo,
                zmax=1,
                colorscale=SCALE,
                name=m.kind,
                colorbar=dict(title=dict(text="cosine"), thickness=14),
                hovertemplate="token %{y} vs %{x}<br>cos %{z:.3f}<extra></extra>",
            ),
            row=1,
            col=i,
        )
        unit_text = "token" + when(m.block != 1, f" (mean over blocks of {m.block})")
        fig.update_xaxes(title_text=f"earlier {unit_text}", row=1, col=i, constrain="domain")
        fig.update_yaxes(
            title_text=unit_text if i == 1 else None,
            autorange="reversed",
            scaleanchor=f"x{i if i > 1 else ''}",
            row=1,
            col=i,
            constrain="domain",
        )
    which = "KV head" if "query" not in kinds else "query head"
    head_text = f"{head}" + when(mixed, f" (KV head {head // group})")
    names = " and ".join(m.kind for m in maps)
    title = f"Cosine similarity of {names} states, layer {layer}, {which} {head_text} ({run_model(run)})"
    fig = finish(fig, title, "similarity", run, layer=layer, head=head, kind=kinds, max_size=max_size)
    fig.update_layout(width=WIDTH if len(maps) == 1 else 1100, height=520)
    return fig


@register_analysis
class SimilarityAnalysis(Analysis):
    name = "similarity"
    paper = "KVMerger Fig. 2, CORM Fig. 3"
    level = RecordLevel.STATES
    params = (
        LAYER,
        Param("head", 0, kind="int", help="KV head (a query head for queries)"),
        Param(
            "state",
            "key",
            kind="text",
            help="query, key or value; a figure also takes several, comma-separated "
            "(key,value: panels on one colour scale)",
        ),
        Param(
            "max_size",
            512,
            kind="int",
            help="at most this many cells per side (longer prompts are block-averaged)",
            minimum=1,
        ),
    )

    def compute(self, run, layer, head, state, max_size):
        return similarity_map(
            run, layer_or_middle(run, layer), head, parse_states(state, many=False)[0], max_size
        )

    def to_json(self, m, **params) -> dict:
        return {
            "layer": m.layer,
            "head": m.head,
            "state": m.kind,
            "tokens": m.tokens,
            "block": m.block,
            "edges": m.edges.tolist(),
            "matrix": nan_to_none(m.matrix),
        }

    def figure(self, run, layer, head, state, max_size):
        return similarity_figure(run, layer_or_middle(run, layer), head, parse_states(state), max_size)
