"""The Benchmarks page's `kvlens eval` tab: lm-eval's scores of each `kvlens eval --out` folder found.

A folder counts when it holds both `results.json` (lm-eval's output) and `kvlens.json` (kvlens's summary,
`kvlens.eval.run`); the tab finds them under the results folder (`results_dir()`), at most three levels down.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from kvlens.ui.results import results_dir

DEPTH = 3


def eval_folders(root: Path) -> list[Path]:
    """The `kvlens eval` output folders under `root` (itself included), sorted."""
    found = [
        p.parent for depth in range(DEPTH + 1) for p in root.glob("/".join(["*"] * depth + ["kvlens.json"]))
    ]
    return sorted(p for p in found if (p / "results.json").is_file())


def eval_table(folders: list[Path], root: Path) -> pd.DataFrame:
    """One row per folder, task and metric: the policy, ratio, value, kept share of bytes, requests, time.
    A folder whose files do not read as JSON is skipped."""
    rows = []
    for folder in folders:
        try:
            results = json.loads((folder / "results.json").read_text(encoding="utf-8"))["results"]
            summary = json.loads((folder / "kvlens.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError):
            continue
        for task, metrics in results.items():
            for metric, value in metrics.items():
                if isinstance(value, (int, float)) and not metric.startswith(("sample_len", "alias")):
                    rows.append(
                        {
                            "folder": str(folder.relative_to(root)),
                            "policy": summary.get("policy"),
                            "ratio": summary.get("ratio"),
                            "task": task,
                            "metric": metric,
                            "value": value,
                            "kept_share": summary.get("kept_share"),
                            "requests": summary.get("requests"),
                            "seconds": summary.get("seconds"),
                        }
                    )
    return pd.DataFrame(rows)


def eval_section() -> None:
    """The tab: the table of every `kvlens eval` folder under the results folder, or how to make one."""
    root = results_dir()
    table = eval_table(eval_folders(root), root) if root.is_dir() else pd.DataFrame()
    if table.empty:
        st.caption(
            f"No `kvlens eval` output under {root}. Make one with `kvlens eval --tasks kvlens_passkey "
            f"--policy snapkv --ratio 0.5 --out {root / 'eval-snapkv'}`."
        )
        return
    st.caption(f"lm-eval's scores of the `kvlens eval` folders under {root} (results.json, kvlens.json).")
    st.dataframe(table, hide_index=True, width="stretch")
