"""Every eviction and merge of one layer and KV head, step x original position (the run's decision log).

Reads `run.decisions` (one row per eviction or merge: step, action, layer, kv_head, position,
targets, weights, prob, draw); merges show their targets, weights and Bernoulli draw on hover.
"""

from __future__ import annotations

import plotly.graph_objects as go

from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.figures.plots import run_path
from kvlens.figures.wording import when

MAX_POINTS = 20000  # the figure draws at most this many decisions

UNDRAWN = {0: "circle-open"}  # the marker of a merge whose Bernoulli draw was 0 (it moved nothing)


@register_analysis
class DecisionsAnalysis(Analysis):
    name = "decisions"
    paper = "the decision log (every compressing policy)"
    params = (Param("layer", 0, kind="int", help="layer"), Param("kv_head", 0, kind="int", help="KV head"))

    def compute(self, run, layer, kv_head):
        d = run.decisions
        return d[(d["layer"] == layer) & (d["kv_head"] == kv_head)]

    def to_json(self, rows, **params) -> dict:
        return {
            **params,
            "evictions": int((rows["action"] == "evict").sum()),
            "merges": int((rows["action"] == "merge").sum()),
            **{k: rows[k].tolist() for k in ("step", "action", "position")},
        }

    def figure(self, run, layer, kv_head):
        """Step x original position of each decision (draw 0 = the mask merged nothing: hollow marker)."""
        d = self.compute(run, layer, kv_head).head(MAX_POINTS)
        fig = go.Figure()
        styles = {
            "evict": dict(color="#888888", symbol="x-thin-open", size=7),
            "merge": dict(color="#D55E00", symbol="circle", size=8),
        }
        for action, style in styles.items():
            rows = d[d["action"] == action]
            if not len(rows):
                continue
            hover = [
                f"{action} position {p} at step {s}"
                + (
                    f"<br>into {list(map(int, t))}<br>weights {[round(float(x), 3) for x in w]}"
                    + when(pr == pr, f"<br>p = {pr:.3f}, draw {dr}")
                    if action == "merge"
                    else ""
                )
                for s, p, t, w, pr, dr in zip(
                    rows["step"],
                    rows["position"],
                    rows["targets"],
                    rows["weights"],
                    rows["prob"],
                    rows["draw"],
                    strict=True,
                )
            ]
            marker = dict(style)
            if action == "merge":
                marker["symbol"] = [UNDRAWN.get(dr, "circle") for dr in rows["draw"]]
            fig.add_trace(
                go.Scatter(
                    x=rows["step"].tolist(),
                    y=rows["position"].tolist(),
                    mode="markers",
                    name=action,
                    marker=marker,
                    hovertext=hover,
                    hoverinfo="text",
                )
            )
        fig.update_xaxes(title_text="step (0 = compression right after the prompt)")
        fig.update_yaxes(title_text="original token position")
        fig.update_layout(
            title=dict(text=f"Decisions of layer {layer}, KV head {kv_head} ({len(d)} shown)"),
            height=420,
            legend=dict(orientation="h", y=1.08),
            meta={
                "analysis": "decisions",
                "params": {"layer": layer, "kv_head": kv_head},
                "run": run_path(run),
            },
        )
        return fig
