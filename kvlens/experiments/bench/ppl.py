"""Perplexity table: policies x budgets x texts, teacher forced (WeightedKV Table I, CORM Table 3).

The cells are `kvlens sweep`'s (`kvlens.experiments.sweep.plan_ppl`, task `ppl`): each prefills `prefill`
tokens of a text, compresses to the budget and scores the next `tokens` tokens one at a time
(`kvlens.experiments.api.perplexity`, the same as `kvlens ppl`). `full` and budget-free policies (CORM) run
once per text, whatever the budgets. This module summarises the rows, as a table and a figure.
"""

from __future__ import annotations

import math

from kvlens.experiments.bench.common import label, mean, spread


def budget_key(row: dict) -> int | float | str:
    """A row's budget as a table key: slots, share, "full" (no compression) or "auto" (budget-free policy)."""
    if row["budget"] is not None:
        return row["budget"]
    return "full" if row["policy"] == "full" else "auto"


def _numeric(summary: list[dict]) -> list:
    """The numeric budgets of a summary, slots (descending) then shares (descending)."""
    return sorted(
        {s["budget"] for s in summary if not isinstance(s["budget"], str)},
        key=lambda b: (isinstance(b, float), -b),
    )


def summarise(rows: list[dict]) -> list[dict]:
    """Per (policy, budget): ppl spread over texts, mean slots kept, and mean ppl / full's mean ppl."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((label(row), budget_key(row)), []).append(row)
    full = groups.get(("full", "full"))
    full_mean = mean(r["ppl"] for r in full or [])
    out = []
    for (policy, budget), group in groups.items():
        s = spread(r["ppl"] for r in group)
        out.append(
            {
                "policy": policy,
                "budget": budget,
                "budget_slots_mean": spread(r["kept_final_mean"] for r in group)["mean"],
                "ppl_mean": s["mean"],
                "ppl_std": s["std"],
                "ppl_min": s["min"],
                "ppl_max": s["max"],
                "texts": s["n"],
                "log_ppl_mean": spread(math.log(r["ppl"]) for r in group)["mean"],
                "vs_full": s["mean"] / full_mean if full_mean else None,
            }
        )
    return out


def markdown_table(summary: list[dict]) -> str:
    """Rows = policies, columns = budgets; cells `mean ± std` ppl (WeightedKV Table I layout)."""
    budgets = _numeric(summary)
    policies = list(dict.fromkeys(s["policy"] for s in summary))
    cell = {(s["policy"], s["budget"]): f"{s['ppl_mean']:.2f} ± {s['ppl_std']:.2f}" for s in summary}
    own = {s["policy"]: s["budget"] for s in summary if isinstance(s["budget"], str)}  # full / budget-free
    lines = [
        "| policy | " + " | ".join(_budget_name(b) for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for p in policies:
        row = (
            [cell[(p, own[p])] + {"full": ""}.get(own[p], f" ({own[p]})") for _ in budgets]
            if p in own
            else [cell.get((p, b), "") for b in budgets]
        )
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _budget_name(b) -> str:
    return f"{b:.0%} of prompt" if isinstance(b, float) else f"{b} slots"


def figure(result: dict):
    """Mean perplexity (error bars: std over texts) against budget, one line per policy; full dashed."""
    import plotly.graph_objects as go

    from kvlens.figures.plots import line_style  # also registers the "kvlens" paper template

    summary = result.get("summary") or summarise(result["rows"])  # an unfinished benchmark has no summary yet
    slots = {s["budget"]: s["budget_slots_mean"] for s in summary}
    budgets = sorted(_numeric(summary), key=lambda b: slots.get(b) or 0)  # smallest cache first
    names = [_budget_name(b) for b in budgets]
    fig = go.Figure()
    for i, policy in enumerate(dict.fromkeys(s["policy"] for s in summary)):
        group = {s["budget"]: s for s in summary if s["policy"] == policy}
        own = [b for b in group if isinstance(b, str)]
        if own:  # full or a budget-free policy: one value, drawn flat across the budgets
            s = group[own[0]]
            fig.add_trace(
                go.Scatter(
                    x=names,
                    y=[s["ppl_mean"]] * len(names),
                    name=f"{policy} ({own[0]})",
                    mode="lines",
                    line={**line_style(i)["line"], "dash": "dot"},
                )
            )
            continue
        fig.add_trace(
            go.Scatter(
                x=names,
                y=[group.get(b, {}).get("ppl_mean") for b in budgets],
                error_y={"array": [group.get(b, {}).get("ppl_std") for b in budgets]},
                name=policy,
                mode="lines+markers",
                **line_style(i),
            )
        )
    c = result["config"]
    fig.update_layout(
        title=f"Perplexity by KV budget ({c['prefill']} prompt + {c['tokens']} scored tokens, "
        f"{len(c['texts'])} texts; bars: std over texts)",
        xaxis_title="budget per KV head per layer",
        yaxis_title="perplexity",
        width=900,
        height=520,
        template="kvlens",
    )
    return fig
