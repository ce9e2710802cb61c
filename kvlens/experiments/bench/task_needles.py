"""The task suite's needles by depth and length: the field's needle-in-a-haystack figure, from the
leaderboard's rows.

Each expected answer of a niah task is one needle (`ruler`: its number, at its sentence-boundary depth; the
row's `needle_depths`, shaped as its `answers`), found when its question's answer holds it (RULER's string
match, per string). `grid` counts the needles found per (policy, ratio, length, depth bin); `figure` draws one
heatmap per policy at one ratio, depth down and length across (Kamradt's needle-in-a-haystack layout,
kvpress's and RULER's depth x length figure). `fill_depths` recovers the depths of rows written before they
were recorded: a generated sample is a function of its cell, so it is generated again (the answers must match
the row's).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from kvlens.experiments.bench import ruler
from kvlens.figures.wording import suffix

BINS = 10  # depth bins of the figure: tenths of the context


def fill_depths(rows: list[dict], count_tokens: Callable[[str], int], haystack: str) -> int:
    """Give each generated niah row without `needle_depths` its sample's (regenerated with its cell's seed,
    depths and count; rows from before the `depths` option: random). Returns how many rows got them."""
    filled = 0
    for row in rows:
        if (
            row.get("needle_depths") is not None
            or not str(row.get("suite_task", "")).startswith("niah_")
            or row.get("seed") is None
        ):
            continue
        sample = ruler.generate(
            row["suite_task"],
            row["length"],
            row["index"],
            count_tokens,
            haystack,
            seed=row["seed"],
            depths=row.get("depths", "random"),
            count=row.get("count", 1),
        )
        if [list(a) for a in sample.answers] == row.get("answers"):
            row["needle_depths"] = [list(d) for d in sample.depths]
            filled += 1
    return filled


def grid(rows: list[dict], bins: int = BINS) -> list[dict]:
    """Per (policy, ratio, length, depth bin) over the niah rows with depths: needles found and needles
    asked."""
    cells: dict[tuple, list[int]] = {}
    for row in rows:
        depths = row.get("needle_depths")
        if depths is None or not str(row.get("suite_task", "")).startswith("niah_"):
            continue
        for res in row["results"]:
            for output, answers, where in zip(res["outputs"], row["answers"], depths, strict=True):
                for answer, depth in zip(answers, where, strict=True):
                    key = (res["policy"], res["ratio"], row["length"], min(int(depth * bins), bins - 1))
                    cells.setdefault(key, []).append(answer.lower() in output.lower())
    return [
        {
            "policy": p,
            "ratio": r,
            "length": n,
            "depth": b / bins,
            "found": statistics.fmean(v),
            "needles": len(v),
        }
        for (p, r, n, b), v in cells.items()
    ]


def default_ratio(cells: list[dict]) -> float | None:
    """The ratio the exported figure shows: the grid's middle one (`middle_ratio`), None if it has none."""
    return middle_ratio([c["ratio"] for c in cells])


def middle_ratio(ratios: list[float | None]) -> float | None:
    """The middle (upper median) of a grid's compression ratios, the full cache's and budget-free ones
    aside."""
    kept = sorted({r for r in ratios if r not in (None, 0.0)})
    return kept[len(kept) // 2] if kept else None


def figure(cells: list[dict], ratio: float | None, protocol: str = "", columns: int = 5):
    """One heatmap per policy (the full cache and budget-free ones as they are): needle depth (rows, bins) x
    context length (columns), colour = share of the needles found, at compression ratio `ratio`, the grid's
    `protocol` (`tasks.protocol`) in the title; None without cells."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import kvlens.figures.plots  # noqa: F401  registers the "kvlens" paper template

    shown = [c for c in cells if c["ratio"] in (ratio, None, 0.0)]
    if not shown:
        return None
    policies = list(dict.fromkeys(c["policy"] for c in shown))
    lengths = sorted({c["length"] for c in shown})
    depths = sorted({c["depth"] for c in shown})
    rows = -(-len(policies) // columns)
    fig = make_subplots(
        rows=rows,
        cols=min(columns, len(policies)),
        subplot_titles=policies,
        shared_yaxes=True,
        shared_xaxes=True,
        horizontal_spacing=0.02,
        vertical_spacing=0.3 / rows,
    )
    at = {(c["policy"], c["length"], c["depth"]): c for c in shown}
    for i, policy in enumerate(policies):
        got = [[at.get((policy, n, d), {}) for n in lengths] for d in depths]  # {}: no cell there
        fig.add_trace(
            go.Heatmap(
                z=[[c.get("found") for c in line] for line in got],
                x=[str(n) for n in lengths],
                y=[f"{d:.0%}" for d in depths],
                zmin=0,
                zmax=1,
                colorscale="RdYlGn",
                showscale=i == 0,
                colorbar={"title": "found"},
                name=policy,
                meta={"value": "the share of the needles at that depth and length found in the answer"},
                xgap=2,
                ygap=2,
                customdata=[[c.get("needles", 0) for c in line] for line in got],
                hovertemplate="%{x} tokens, depth %{y}: %{z:.0%} of %{customdata} needles<extra>"
                + policy
                + "</extra>",
            ),
            i // columns + 1,
            i % columns + 1,
        )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    for r in range(1, rows + 1):
        fig.update_yaxes(title_text="needle depth", row=r, col=1)
    at_ratio = "the full cache" if ratio is None else f"compression ratio {ratio:g}"
    at_ratio += suffix(" ({})", protocol)
    fig.update_layout(
        title=f"Needles found by depth and context length, {at_ratio}",
        width=max(520, 200 * min(columns, len(policies)) + 160),
        height=140 + 260 * rows,
        template="kvlens",
    )
    return fig
