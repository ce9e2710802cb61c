"""Summarise `kvlens sweep --measure` results of CaM presets and their base (README "Results (a)").

    python scripts/cam_sweep_summary.py SWEEP.json [SWEEP.json ...] [--figure PNG]

Groups the rows by budget and policy variant (CaM rows by their preset, recognised from the
resolved parameters), prints one markdown table per budget with mean ± std over the cells
(texts x seeds) and a paired comparison with the base on the same text: the perplexity ratio and
the pooled perturbation difference (seeds averaged per text), each with a bootstrap 95 % interval
over the texts (with 5 texts, a coarse interval). `--figure`
draws CaM Fig. 1(d) style bars (pooled perturbation, merged vs the same run's eviction) with std
(PNG, and the CSV and JSON beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from kvlens.experiments.bench.common import bootstrap
from kvlens.policies import make_policy, presets

METRICS = ("ppl", "perturbation_used_pooled", "perturbation_evict_pooled", "kl")


def variant(row: dict) -> str:
    """`cam:PRESET` when the row's CaM parameters equal a preset's, else the policy name."""
    if row["policy"] != "cam":
        return row["policy"]
    for name, values in presets("cam").items():
        if (
            make_policy("cam", {**row["params"], **values}).params()
            == make_policy("cam", row["params"]).params()
        ):
            return f"cam:{name}"
    return "cam:custom"


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4g} ± {statistics.stdev(values):.2g}" if len(values) > 1 else f"{mean:.4g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+")
    parser.add_argument("--figure")
    args = parser.parse_args()
    rows = [r for path in args.sweeps for r in json.load(open(path, encoding="utf-8"))["rows"] if "ppl" in r]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["budget"], variant(r))].append(r)
    base = {(r["budget"], r["text"]): r for r in rows if r["policy"] != "cam"}
    for budget in sorted({b for b, _ in groups}):
        print(f"\nbudget {budget}\n")
        print(
            "| variant | cells (texts) | ppl | pooled perturbation | pooled, evicted (same run) "
            "| KL (steps 1..) "
            "| ppl / base ppl (95% CI) | pooled CaM - evicted (95% CI) |"
        )
        print("|---" * (len(METRICS) + 4) + "|")
        for (b, name), cells in sorted(groups.items()):
            if b != budget:
                continue
            texts = sorted({c["text"] for c in cells})
            cols = [spread([c[m] for c in cells]) for m in METRICS]
            ratio = [
                statistics.fmean(c["ppl"] for c in cells if c["text"] == t) / base[(b, t)]["ppl"]
                for t in texts
                if (b, t) in base
            ]
            diff = [
                statistics.fmean(
                    c["perturbation_used_pooled"] - c["perturbation_evict_pooled"]
                    for c in cells
                    if c["text"] == t
                )
                for t in texts
            ]
            r_lo, r_hi = bootstrap([ratio]) if ratio else (float("nan"),) * 2
            d_lo, d_hi = bootstrap([diff])
            print(
                f"| {name} | {len(cells)} ({len(texts)}) | "
                + " | ".join(cols)
                + f" | {statistics.fmean(ratio):.3f} [{r_lo:.3f}, {r_hi:.3f}] | "
                f"{statistics.fmean(diff):+.4f} [{d_lo:+.4f}, {d_hi:+.4f}] |"
            )
    if args.figure:
        figure(
            groups,
            args.figure,
            "python scripts/cam_sweep_summary.py " + " ".join(args.sweeps) + f" --figure {args.figure}",
        )
    return 0


def figure(groups, path: str, command: str) -> None:
    """Bars of the pooled perturbation per preset, merged vs evicted, ± std over cells; one panel per
    budget."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from kvlens.figures.export import export_figure

    budgets = sorted({b for b, _ in groups})
    names = sorted({n for _, n in groups if n.startswith("cam:")})
    fig = make_subplots(
        rows=1, cols=len(budgets), subplot_titles=[f"budget {b} of the prompt" for b in budgets]
    )
    for col, budget in enumerate(budgets, start=1):
        for metric, label, color in (
            ("perturbation_used_pooled", "merged (CaM)", "#E76F51"),
            ("perturbation_evict_pooled", "evicted (same decisions)", "#264653"),
        ):
            cells = [groups.get((budget, n), []) for n in names]
            fig.add_trace(
                go.Bar(
                    x=[n.removeprefix("cam:") for n in names],
                    name=label,
                    marker_color=color,
                    y=[statistics.fmean(c[metric] for c in cs) if cs else None for cs in cells],
                    error_y={
                        "type": "data",
                        "array": [
                            statistics.stdev(c[metric] for c in cs) if len(cs) > 1 else 0 for cs in cells
                        ],
                    },
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        title="CaM presets: pooled perturbation (mean ± std over cells)",
        barmode="group",
        width=300 + 450 * len(budgets),
        height=440,
        template="plotly_white",
    )
    fig.update_yaxes(title_text="sum |O - O_full| / sum |O_full|", col=1)
    export_figure(fig, path, command=command)


if __name__ == "__main__":
    raise SystemExit(main())
