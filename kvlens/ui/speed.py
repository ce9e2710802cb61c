"""The Benchmarks page's Speed and memory section: the ratios of `kvlens.figures.speed` as a chart and two
tables (the worst policy of each measure, then every policy), the headline ratios against their targets, and
the raw JSON behind an expander."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from kvlens.figures.speed import (
    dict_at,
    families,
    judged_in_cpu_time,
    met_text,
    policy_table,
    speed_figure,
    worst_table,
)
from kvlens.ui.charts import chart


def speed_section(path: Path, settings: dict, frame: pd.DataFrame, raw: dict) -> None:
    found = families(raw)
    if not found:
        st.info(f"{path.name} holds no policy measured against the full cache of its prompt length.")
    else:
        lockstep = not found[0].key.startswith("rows:")
        chart(
            speed_figure(found),
            f"bench_fig_{path.stem}",
            name=path.stem,
            config={"results": str(path), **settings.get("config", {})},
            data=policy_table(found),
        )
        st.caption(
            "Each bar: a policy's cost over the full cache's at that prompt length (below 1: cheaper). "
            + (
                "Measured in lockstep, the median over rounds (`ratio_details`)."
                if lockstep
                else "From the rows: one unmeasured run per policy and length, over full's run of that "
                "length (this file has no every-policy lockstep families)."
            )
        )
        st.markdown("**The worst policy of each measure**")
        worst = worst_table(found).set_index("measure")
        st.table(worst.style.format({"its ratio": "{:.3f}"}))  # static: the verdict's sentence wraps
    headline = targets_table(raw)
    if len(headline):
        st.markdown("**Targets**")
        st.table(headline.set_index("ratio name").style.format({"ratio": "{:.3f}"}, na_rep=""))
    with st.expander(f"Every run ({len(frame)} rows)"):
        st.dataframe(frame, hide_index=True, width="stretch")
    with st.expander("Raw ratios, targets and growth (JSON)"):
        st.json(
            {k: raw[k] for k in ("ratios", "ratios_cpu", "targets", "growth", "ratio_details") if k in raw}
        )


def targets_table(raw: dict) -> pd.DataFrame:
    """A row per ratio that has a target: the value it was judged on (CPU time where the target says so), the
    target and whether it was met."""
    ratios, cpu, targets = dict_at(raw, "ratios"), dict_at(raw, "ratios_cpu"), dict_at(raw, "targets")
    return pd.DataFrame(
        [
            {
                "ratio name": k,
                "ratio": (cpu if judged_in_cpu_time(t) and k in cpu else ratios).get(k),
                "target": t.get("target"),
                "met": met_text(t),
            }
            for k, t in targets.items()
            if isinstance(t, dict)
        ],
        columns=["ratio name", "ratio", "target", "met"],
    )
