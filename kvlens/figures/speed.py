"""The speed benchmark's results (`results/bench_speed.json`) drawn: each policy's decode, prefill and KV
bytes against the full cache (and decode against its floor, where measured), one panel per measure, a bar per
policy and prompt length.

The ratios come from the file's `every_policy_*` families (`ratio_details[name]["per_policy"]`, measured in
lockstep; in CPU time, `["cpu"]`, where the family's target is judged in CPU time); a file without them gets
the same three measures from its rows (one run per policy and length, each over `full`'s run of that length).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.figures.plots import COLORS
from kvlens.figures.wording import IN_CPU_TIME

# measure -> its panel title (prefill: prefill and step-0 compression; floor: the full cache on as many slots)
MEASURES = {
    "decode": "decode ms/token ÷ full",
    "prefill": "prefill ms ÷ full",
    "bytes": "KV bytes ÷ full",
    "floor": "decode ms/token ÷ its floor",
}
_FAMILY = re.compile(r"every_policy_(half_vs_full|prefill_vs_full|bytes_half_vs_full|vs_floor)_at_(\d+)")
_MEASURE = {"half_vs_full": "decode", "prefill_vs_full": "prefill", "bytes_half_vs_full": "bytes"}
_IN_CPU_TIME = {
    False: ("per_policy", "worst"),
    True: ("cpu", "worst_cpu"),
}  # a family's medians and its worst


@dataclass(frozen=True)
class Family:
    """One measure at one prompt length: {policy: ratio}, the worst policy, the file's key, and its target's
    verdict (`targets[key]`: target, met, exception); `cpu` when the ratios are in CPU time."""

    measure: str
    length: int
    per_policy: dict[str, float]
    worst: str
    key: str
    verdict: dict | None = None
    cpu: bool = False


def met_text(verdict: dict) -> str:
    """A target's verdict (`kvlens bench speed`'s `targets[name]`) in words: `yes`, `no`, or `no` with the
    exception it names (a method whose rule alone misses the target); empty for a ratio without a target."""
    if not verdict:
        return ""
    if verdict.get("met"):
        return "yes"
    return f"no: exception, {verdict['exception']}" if verdict.get("exception") else "no"


def judged_in_cpu_time(verdict: dict) -> bool:
    """Whether a target's verdict (`targets[name]`) was judged on the ratio in process CPU time."""
    return IN_CPU_TIME in str(verdict.get("target", ""))


def dict_at(raw: dict, key: str) -> dict:
    """The dict under `key`, or an empty one (a results file missing it or holding something else)."""
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def families(raw: dict) -> list[Family]:
    """The file's `every_policy_*` families, or (none there) the ratios its rows give; by measure, then
    length."""
    details, targets = dict_at(raw, "ratio_details"), dict_at(raw, "targets")
    out = []
    for key, d in details.items():
        match = _FAMILY.fullmatch(key)
        if match and isinstance(d, dict) and isinstance(d.get("per_policy"), dict) and d["per_policy"]:
            verdict = dict_at(targets, key)
            cpu = judged_in_cpu_time(verdict) and isinstance(d.get("cpu"), dict)
            medians, named = _IN_CPU_TIME[cpu]
            per = {str(p): float(v) for p, v in d[medians].items()}
            worst = d.get(named)
            if worst not in per:
                worst = max(per, key=per.__getitem__)
            measure = _MEASURE.get(match.group(1), "floor")
            out.append(Family(measure, int(match.group(2)), per, str(worst), key, verdict, cpu))
    if not out:
        out = _from_rows([r for r in raw.get("rows", []) if isinstance(r, dict)])
    order = list(MEASURES)
    return sorted(out, key=lambda f: (order.index(f.measure), f.length))


def _from_rows(rows: list[dict]) -> list[Family]:
    """Decode, prefill and bytes of each policy over `full`'s row of the same prompt length."""
    out = []
    columns = {"decode": "ms_per_token", "prefill": "prefill_ms", "bytes": "kv_bytes_peak"}
    for length in sorted({r.get("prompt_tokens") for r in rows if isinstance(r.get("prompt_tokens"), int)}):
        here = {r["policy"]: r for r in rows if r.get("prompt_tokens") == length and "policy" in r}
        full = here.get("full")
        if full is None:
            continue
        for measure, column in columns.items():
            per = {
                p: r[column] / full[column]
                for p, r in here.items()
                if p != "full" and isinstance(r.get(column), (int, float)) and full.get(column)
            }
            if per:
                worst = max(per, key=per.__getitem__)
                out.append(Family(measure, length, per, worst, f"rows: {column} at {length}"))
    return out


def policy_table(found: list[Family]) -> pd.DataFrame:
    """A row per policy, a column per family (`decode @ 1024`, `prefill CPU @ 4096`, ...): the chart's
    numbers."""
    policies = sorted({p for f in found for p in f.per_policy})
    columns = {f"{f.measure}{' CPU' * f.cpu} @ {f.length}": f for f in found}
    return pd.DataFrame(
        [{"policy": p, **{c: f.per_policy.get(p) for c, f in columns.items()}} for p in policies]
    )


def worst_table(found: list[Family]) -> pd.DataFrame:
    """A row per family: the measure (as its panel is titled), the prompt length, the worst policy, its ratio,
    the target and the verdict."""
    return pd.DataFrame(
        [
            {
                "measure": panel_title(f.measure, [f]),
                "prompt tokens": f.length,
                "worst policy": f.worst,
                "its ratio": f.per_policy[f.worst],
                "target": (f.verdict or {}).get("target", ""),
                "met": met_text(f.verdict or {}),
            }
            for f in found
        ]
    )


def panel_title(measure: str, found: list[Family]) -> str:
    """A measure's panel title (`decode ms/token ÷ full`), in CPU time where its families' ratios are."""
    title = MEASURES[measure]
    if any(f.cpu for f in found if f.measure == measure):
        return title.replace(" ms", " CPU ms", 1)
    return title


def speed_figure(found: list[Family]) -> go.Figure:
    """A panel per measure, a horizontal bar per policy and prompt length (the policies on a shared axis),
    a dotted line at 1 (as costly as the full cache, or as its floor)."""
    measures = list(dict.fromkeys(f.measure for f in found))
    lengths = sorted({f.length for f in found})
    policies = sorted({p for f in found for p in f.per_policy})
    fig = make_subplots(
        rows=1,
        cols=len(measures),
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=[panel_title(m, found) for m in measures],
    )
    for col, measure in enumerate(measures, start=1):
        for i, length in enumerate(lengths):
            family = next((f for f in found if f.measure == measure and f.length == length), None)
            if family is None:
                continue
            fig.add_trace(
                go.Bar(
                    y=policies,
                    x=[family.per_policy.get(p) for p in policies],
                    orientation="h",
                    name=f"{length} tokens",
                    legendgroup=str(length),
                    showlegend=col == 1,
                    marker_color=COLORS[(i + 1) % len(COLORS)],
                    hovertemplate="%{y}: %{x:.3f}<extra>" + f"{length} tokens</extra>",
                ),
                row=1,
                col=col,
            )
        fig.add_vline(x=1.0, line=dict(color="#777777", dash="dot", width=1), row=1, col=col)
        fig.update_xaxes(title_text="ratio", rangemode="tozero", row=1, col=col)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_layout(
        template="kvlens",
        barmode="group",
        width=None,
        height=160 + 16 * len(policies) * max(1, len(lengths)),
        margin=dict(l=120, r=20, t=90, b=100),
        legend=dict(orientation="h", x=0, y=0, yanchor="bottom", yref="container", title_text="prompt"),
        title=dict(text="Speed and memory of each policy against the full cache"),
        meta={"benchmark": "speed", "families": [f.key for f in found]},
    )
    return fig
