"""What the cache held over a run: attention maps (CaM Fig. 1 a-c style) and merge provenance, which
the app's Attention and Merges pages and the token inspector draw (the `attention` analysis too).

`layer_cache` turns a `--record attention` run's per-step rows (`attn/{layer}` `(R, Hq, Smax)`,
`attn_pos/{layer}` `(R, Hkv, Smax)`; row 0 = the last prompt token's query, row r >= 1 = the decode forward
that fed generated token r - 1) into a query-step x position grid: the attention each cached position
received, and each cell's status (not yet seen, evicted, merged away, kept, holding merged values, sink), for
every head of a layer at once; `attention_grid` is one head's, and the head grid reads all of them. Cache
state at row r reflects the decisions of steps < r. `attention_grid`'s long runs are block-pooled to at most
`max_cells` per axis (attention: mean over the block's cached cells; status: the highest code in the block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch

from kvlens.errors import KvlensError
from kvlens.figures.plots import run_path
from kvlens.figures.wording import when
from kvlens.runs.run import Run

# status codes, in pooling priority (higher wins when blocks are pooled)
FUTURE, EVICTED, MERGED_AWAY, KEPT, HOLDS_MERGE, SINK = range(6)
STATUS = {
    FUTURE: ("not yet seen", "#ffffff"),
    EVICTED: ("evicted", "#c8c8c8"),
    MERGED_AWAY: ("merged away", "#f2b37a"),
    KEPT: ("kept", "#dde8f5"),
    HOLDS_MERGE: ("holds merged values", "#d62728"),
    SINK: ("sink", "#111111"),
}


@dataclass
class AttentionGrid:
    """`weights` `(R', P')` attention (NaN where no cached slot), `status` `(R', P')` codes above;
    `rows` / `cols` the first query row / position of each (pooled) cell; `block` the pooling."""

    layer: int
    head: int
    weights: torch.Tensor
    status: torch.Tensor
    rows: list[int]
    cols: list[int]
    block: tuple[int, int]
    prompt_len: int


def recorded_attention_layers(run: Run) -> list[int]:
    layers = sorted(int(n.split("/")[1]) for n in run.tensors if n.startswith("attn/"))
    if not layers:
        raise KvlensError("This run has no per-step attention rows; record it with --record attention.")
    return layers


def _merge_steps(run: Run, layer: int, kv_heads: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(merged_at, holds_from)` `(Hkv, P)` of `layer`: the first step at which each position was merged away,
    and the first at which it received merged values (a large number where never), from the decision log."""
    never = 1 << 30
    merged_at = torch.full((kv_heads, n_pos), never, dtype=torch.long)
    holds_from = torch.full((kv_heads, n_pos), never, dtype=torch.long)
    d = run.decisions
    if d is None or not len(d):
        return merged_at, holds_from
    d = d[(d["action"] == "merge") & (d["layer"] == layer)]
    if "draw" in d:
        d = d[d["draw"] != 0]  # a Bernoulli draw of 0 merged nothing
    if not len(d):
        return merged_at, holds_from
    step = torch.tensor(d["step"].to_numpy(dtype="int64"))
    kv = torch.tensor(d["kv_head"].to_numpy(dtype="int64"))
    pos = torch.tensor(d["position"].to_numpy(dtype="int64"))
    ok = (pos >= 0) & (pos < n_pos)
    merged_at.view(-1).scatter_reduce_(0, (kv * n_pos + pos)[ok], step[ok], reduce="amin")
    counts = torch.tensor([len(t) for t in d["targets"]])
    t_pos = torch.tensor([int(t) for ts in d["targets"] for t in ts], dtype=torch.long)
    t_kv, t_step = kv.repeat_interleave(counts), step.repeat_interleave(counts)
    ok = (t_pos >= 0) & (t_pos < n_pos)
    holds_from.view(-1).scatter_reduce_(0, (t_kv * n_pos + t_pos)[ok], t_step[ok], reduce="amin")
    return merged_at, holds_from


def layer_cache(run: Run, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head of `layer` at every recorded row: `weights` `(R, Hq, P)` (the attention each position
    received, NaN where it was not cached) and `status` `(R, Hkv, P)` codes (see module docstring), P = every
    position."""
    layers = recorded_attention_layers(run)
    if layer not in layers:
        raise KvlensError(
            f"Layer {layer} has no recorded attention rows; recorded layers: {', '.join(map(str, layers))}."
        )
    attn = run.tensor(f"attn/{layer}").float()  # (R, Hq, Smax)
    pos = run.tensor(f"attn_pos/{layer}").long()  # (R, Hkv, Smax)
    n_rows, hq, _ = attn.shape
    hkv = pos.shape[1]
    prompt_len = len(run.meta.prompt_tokens)
    n_pos = prompt_len + n_rows - 1
    valid = (pos >= 0) & (pos < n_pos)
    slot = torch.where(valid, pos, n_pos)  # column n_pos collects the empty slots, dropped below
    present = torch.zeros(n_rows, hkv, n_pos + 1, dtype=torch.bool).scatter_(2, slot, valid)[..., :n_pos]
    weights = torch.full((n_rows, hq, n_pos + 1), float("nan"))
    weights.scatter_(2, slot.repeat_interleave(hq // hkv, dim=1), attn)
    weights = weights[..., :n_pos]
    rows = torch.arange(n_rows)[:, None, None]
    seen = torch.arange(n_pos)[None, None, :] <= prompt_len - 1 + rows  # (R, 1, P)
    merged_at, holds_from = _merge_steps(run, layer, hkv, n_pos)
    status = torch.full((n_rows, hkv, n_pos), FUTURE, dtype=torch.int8)
    status[seen.expand_as(status)] = EVICTED
    status[~present & (rows > merged_at)] = MERGED_AWAY
    status[present] = KEPT
    status[present & (rows > holds_from)] = HOLDS_MERGE
    sink = int(run.meta.policy.params.get("sink", 0) or 0)
    if sink:
        status[..., :sink][present[..., :sink]] = SINK
    return weights, status


def attention_grid(run: Run, layer: int, head: int, max_cells: int = 512) -> AttentionGrid:
    """The step x position attention grid of query head `head` in `layer` (see module docstring)."""
    weights, status = layer_cache(run, layer)
    hq, hkv = weights.shape[1], status.shape[1]
    if not 0 <= head < hq:
        raise KvlensError(f"Head {head} is out of range: the model has query heads 0 to {hq - 1}.")
    prompt_len = len(run.meta.prompt_tokens)
    return _pool(layer, head, weights[:, head], status[:, head // (hq // hkv)], max_cells, prompt_len)


def _pool(layer, head, weights, status, max_cells, prompt_len) -> AttentionGrid:
    br = math.ceil(weights.shape[0] / max_cells)
    bc = math.ceil(weights.shape[1] / max_cells)
    w, s = pool_blocks(weights.numpy(), status.numpy(), br, bc)
    rows = list(range(0, br * w.shape[0], br))
    cols = list(range(0, bc * w.shape[1], bc))
    return AttentionGrid(
        layer, head, torch.from_numpy(w), torch.from_numpy(s), rows, cols, (br, bc), prompt_len
    )


def pool_blocks(weights: np.ndarray, status: np.ndarray, br: int, bc: int) -> tuple[np.ndarray, np.ndarray]:
    """`weights` and `status` `(R, P)` pooled in blocks of `br` x `bc` cells: the mean attention over the
    block's cached cells (NaN where none is cached) and the highest status code. Numpy: on arrays this small,
    torch's thread pool costs more than the work."""
    if br == 1 and bc == 1:
        return weights, status
    pr, pc = (-weights.shape[0]) % br, (-weights.shape[1]) % bc
    w = np.pad(weights, ((0, pr), (0, pc)), constant_values=np.nan)
    s = np.pad(status, ((0, pr), (0, pc)), constant_values=FUTURE)
    r, c = w.shape[0] // br, w.shape[1] // bc
    w = w.reshape(r, br, c, bc).transpose(0, 2, 1, 3).reshape(r, c, br * bc)
    cached = (~np.isnan(w)).sum(-1)
    with np.errstate(invalid="ignore"):
        pooled = np.nansum(w, -1) / cached  # NaN where the block holds no cached cell
    return pooled.astype(weights.dtype), s.reshape(r, br, c, bc).transpose(0, 2, 1, 3).reshape(r, c, -1).max(
        -1
    )


STATUS_META = {"value": "the cell's status code", "codes": {code: name for code, (name, _) in STATUS.items()}}


def status_scale(colors: dict[int, str] | None = None) -> list:
    """A plotly colour scale mapping each status code (`zmin=-0.5`, `zmax=len(STATUS) - 0.5`) to its colour
    (`colors` overrides some)."""
    scale = []
    for i, code in enumerate(sorted(STATUS)):
        color = (colors or {}).get(code, STATUS[code][1])
        scale += [[i / len(STATUS), color], [(i + 1) / len(STATUS), color]]
    return scale


def status_heatmap(z, **where) -> go.Heatmap:
    """The status codes `z` `(rows, columns)` as a heatmap in their colours (`status_scale`), no colour bar;
    `where`: its coordinates and hover."""
    return go.Heatmap(
        z=z,
        zmin=-0.5,
        zmax=len(STATUS) - 0.5,
        colorscale=status_scale(),
        showscale=False,
        name="status",
        meta=STATUS_META,
        **where,
    )


def attention_heatmap(z, thickness: int, **where) -> go.Heatmap:
    """log10 attention `z` `(rows, columns)` as a Viridis heatmap from 1e-4 to 1, its colour bar `thickness`
    wide; `where`: its coordinates and hover."""
    return go.Heatmap(
        z=z,
        zmin=-4,
        zmax=0,
        colorscale="Viridis",
        name="attention",
        meta={"value": "log10_attention: log10 of the attention weight (a cached cell under 1e-6 at -6)"},
        colorbar=dict(
            title=dict(text="attention"),
            tickvals=[-4, -3, -2, -1, 0],
            ticktext=["≤1e-4", "1e-3", "0.01", "0.1", "1"],
            thickness=thickness,
        ),
        **where,
    )


def status_legend(codes: tuple[int, ...], status) -> list[go.Scatter]:
    """A legend square for each of `codes` that occurs in `status` (the status heatmap has no legend)."""
    return [
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            name=STATUS[code][0],
            marker=dict(symbol="square", size=12, color=STATUS[code][1], line=dict(color="#555", width=1)),
        )
        for code in codes
        if bool((status == code).any())
    ]


def _add_merge_dots(fig: go.Figure, grid: AttentionGrid, max_dots: int) -> None:
    """A red dot on each cell holding merged values (every k-th of them past `max_dots`)."""
    holds = (grid.status == HOLDS_MERGE).nonzero()  # (n, 2) cells drawn over the attention as dots
    if len(holds):
        holds = holds[:: max(1, len(holds) // max_dots)]
        fig.add_trace(
            go.Scatter(
                x=[grid.cols[c] for c in holds[:, 1].tolist()],
                y=[grid.rows[r] for r in holds[:, 0].tolist()],
                mode="markers",
                name=STATUS[HOLDS_MERGE][0],
                hoverinfo="skip",
                marker=dict(symbol="circle", size=3, color=STATUS[HOLDS_MERGE][1]),
            )
        )


def _add_sinks(fig: go.Figure, grid: AttentionGrid) -> None:
    """A black triangle above each column that is a sink at some row."""
    sinks = sorted({grid.cols[c] for c in (grid.status == SINK).any(0).nonzero().flatten().tolist()})
    if sinks:
        fig.add_trace(
            go.Scatter(
                x=sinks,
                y=[grid.rows[0] - max(1, grid.block[0]) * 1.2] * len(sinks),
                mode="markers",
                name="sink",
                cliponaxis=False,
                marker=dict(symbol="triangle-down", size=9, color=STATUS[SINK][1]),
                hovertemplate="sink position %{x}<extra></extra>",
            )
        )


def attention_map_figure(
    run: Run, grid: AttentionGrid, step: int | None = None, max_dots: int = 20000
) -> go.Figure:
    """Heatmap of log10 attention over kept cells on a status background (evicted grey, merged away
    orange); slots holding merged values get red dots (at most `max_dots`), sinks a black triangle
    above their column; `step` draws a guide line."""
    fig = go.Figure()
    names = [[STATUS[int(c)][0] for c in row] for row in grid.status.tolist()]
    where = dict(x=grid.cols, y=grid.rows, customdata=names)
    fig.add_trace(
        status_heatmap(
            grid.status.tolist(),
            hovertemplate="position %{x}, query row %{y}: %{customdata}<extra></extra>",
            **where,
        )
    )
    fig.add_trace(
        attention_heatmap(
            torch.log10(grid.weights.clamp(min=1e-6)).tolist(),
            14,
            hovertemplate="position %{x}, query row %{y}<br>attention 10^%{z:.2f}"
            "<br>%{customdata}<extra></extra>",
            **where,
        )
    )
    for trace in status_legend((EVICTED, MERGED_AWAY), grid.status):
        fig.add_trace(trace)
    _add_merge_dots(fig, grid, max_dots)
    _add_sinks(fig, grid)
    fig.add_vline(x=grid.prompt_len - 0.5, line=dict(color="#444", dash="dot", width=1))
    if step is not None:
        fig.add_hline(y=step, line=dict(color="#d62728", width=1))
    pooled = grid.block != (1, 1)
    xlabel = "token position" + when(pooled, f" (blocks of {grid.block[1]})")
    ylabel = "query row (0 = last prompt token)" + when(pooled, f" (blocks of {grid.block[0]})")
    fig.update_xaxes(title_text=xlabel, range=[-0.5, grid.cols[-1] + grid.block[1] - 0.5])
    fig.update_yaxes(title_text=ylabel, autorange="reversed")
    pol = run.meta.policy.name
    fig.update_layout(
        title=dict(
            text=f"Attention of layer {grid.layer}, head {grid.head} under {pol} (dotted: end of prompt)"
        ),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
        height=520,
        meta={
            "analysis": "attention",
            "params": {"layer": grid.layer, "head": grid.head, "step": step},
            "run": run_path(run),
            "run_command": run.meta.command,
        },
    )
    return fig


def attention_row_figure(grid: AttentionGrid, row: int) -> go.Figure:
    """One query row of the grid as bars over positions, coloured by status."""
    r = min(range(len(grid.rows)), key=lambda i: abs(grid.rows[i] - row))
    w = grid.weights[r]
    st = grid.status[r]
    fig = go.Figure()
    for code in (KEPT, HOLDS_MERGE, SINK):
        mask = (st == code) & ~w.isnan()
        if bool(mask.any()):
            xs = [grid.cols[i] for i in mask.nonzero().flatten().tolist()]
            fig.add_trace(
                go.Bar(
                    x=xs,
                    y=w[mask].tolist(),
                    name=STATUS[code][0],
                    # kept: darker than in the map
                    marker=dict(color={KEPT: "#1f77b4"}.get(code, STATUS[code][1])),
                )
            )
    fig.update_xaxes(title_text="token position")
    fig.update_yaxes(title_text="attention", type="log", dtick=1, exponentformat="power")  # powers of ten
    fig.update_layout(
        title=dict(text=f"Attention row at query row {grid.rows[r]}"),
        barmode="overlay",
        height=300,
        bargap=0,
        legend=dict(orientation="h", y=1.1),
    )
    return fig


def provenance_figure(table, layer: int, kv_head: int, max_slots: int = 512) -> go.Figure:
    """Heatmap of which original positions (x) each merged slot (y) holds, and with what weight."""
    t = table[(table["layer"] == layer) & (table["kv_head"] == kv_head)]
    slots = sorted(t["slot"].unique().tolist())[:max_slots]
    t = t[t["slot"].isin(slots)]
    fig = go.Figure(
        go.Scatter(
            x=t["source"].tolist(),
            y=t["slot"].tolist(),
            mode="markers",
            name="weight",
            marker=dict(
                color=t["weight"].tolist(),
                colorscale="Viridis",
                size=9,
                symbol="square",
                colorbar=dict(title=dict(text="weight"), thickness=14),
                showscale=True,
            ),
            hovertemplate="slot %{y} holds position %{x}<br>weight %{marker.color:.3f}<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=slots,
            y=slots,
            mode="lines",
            line=dict(color="#bbb", dash="dot", width=1),
            hoverinfo="skip",
            showlegend=False,
        )
    )
    fig.update_xaxes(title_text="original token position it holds")
    fig.update_yaxes(title_text="slot (its own position)")
    fig.update_layout(
        title=dict(text=f"Provenance of merged slots, layer {layer}, KV head {kv_head}"),
        height=420,
        showlegend=False,
        meta={"analysis": "provenance", "params": {"layer": layer, "kv_head": kv_head}},
    )
    return fig
