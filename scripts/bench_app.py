"""How long the app takes to open a shipped run and draw its first heatmap (target: under 2 s).

Two measurements, each the median of `--repeat` tries with every Streamlit cache cleared first:
- `builder`: `kvlens.load_run` + the page's figure builder + the figure's JSON (what Streamlit
  sends to the browser), for the Attention map and the Similarity maps;
- `page`: the whole page under `streamlit.testing.v1.AppTest` (app.py, sidebar, run loading,
  analysis, figure, export menu), from a switch to the page until its script finished.

    .venv/bin/python scripts/bench_app.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import streamlit as st

ROOT = Path(__file__).resolve().parent.parent
CASES = [("attention", "streaming_llm-attention"), ("similarity", "full-states")]


def builder_seconds(page: str, run_name: str) -> float:
    from kvlens import load_run
    from kvlens.analysis.kinds.similarity import similarity_figure
    from kvlens.figures.attention import attention_grid, attention_map_figure

    t = time.perf_counter()
    run = load_run(ROOT / "cached_runs" / run_name)
    if page == "attention":
        fig = attention_map_figure(run, attention_grid(run, 15, 0))
    else:
        fig = similarity_figure(run, 17, 0, "key")
    fig.to_json()
    return time.perf_counter() - t


def page_seconds(page: str, run_name: str) -> float:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    at.switch_page(f"pages/{page}.py").run()
    st.cache_data.clear()
    st.cache_resource.clear()
    at.sidebar.selectbox(key="app_run").set_value(str(ROOT / "cached_runs" / run_name))
    t = time.perf_counter()
    at.run()
    took = time.perf_counter() - t
    heat = [c for c in at.get("plotly_chart") if '"heatmap"' in c.proto.spec]
    if at.exception or not heat:
        raise SystemExit(f"{page} on {run_name} drew no heatmap: {[e.value for e in at.exception]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    results = {}
    for page, run_name in CASES:
        for kind, fn in (("builder", builder_seconds), ("page", page_seconds)):
            times = [fn(page, run_name) for _ in range(args.repeat)]
            results[f"{page}/{kind}"] = {
                "run": run_name,
                "median_s": statistics.median(times),
                "max_s": max(times),
            }
            print(
                f"{page:<11} {kind:<8} {run_name:<20} median {statistics.median(times):.3f} s  "
                f"max {max(times):.3f} s",
                flush=True,
            )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
