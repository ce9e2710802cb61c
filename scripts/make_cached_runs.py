"""Regenerate `cached_runs/`: small recorded runs of the embedded model that the app shows at once.

Each run is made by the real CLI (`kvlens generate`), so its `run.json` carries the exact
command that produced it. Prompts are short excerpts of the bundled State of the Union texts and
only a few layers are recorded (`--record-layers`) to keep the folder small; `adakv-heads` records all 30,
so that the Head grid shows a whole model (Ada-KV gives each head its own share of the budget).

    .venv/bin/python scripts/make_cached_runs.py            # all runs
    .venv/bin/python scripts/make_cached_runs.py h2o-attention   # only some
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvlens.runs.run import read_meta
from kvlens.texts import read

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "cached_runs"


def excerpt(name: str, chars: int) -> str:
    """The first `chars` characters of a bundled text, cut at a word boundary."""
    text = " ".join(read(name).split())
    return text[:chars].rsplit(" ", 1)[0]


SHORT = excerpt("1961-Kennedy", 480)  # ~100 tokens
MEDIUM = excerpt("1962-Kennedy", 800)  # ~160 tokens

# name -> arguments of `kvlens generate` (without --out)
RUNS: dict[str, list[str]] = {
    "full-states": [
        "--policy",
        "full",
        "--prompt",
        MEDIUM,
        "--max-new-tokens",
        "16",
        "--record",
        "states",
        "--record-layers",
        "0,5,11,17,23,29",
    ],
    "streaming_llm-attention": [
        "--policy",
        "streaming_llm",
        "--budget",
        "48",
        "--prompt",
        SHORT,
        "--max-new-tokens",
        "40",
        "--record",
        "attention",
        "--record-layers",
        "0,15,29",
    ],
    "h2o-attention": [
        "--policy",
        "h2o",
        "--budget",
        "48",
        "--prompt",
        SHORT,
        "--max-new-tokens",
        "40",
        "--record",
        "attention",
        "--record-layers",
        "0,15,29",
    ],
    "tova-summary": ["--policy", "tova", "--budget", "32", "--prompt", SHORT, "--max-new-tokens", "40"],
    "cam-attention": [
        "--policy",
        "cam",
        "--budget",
        "48",
        "--set",
        "base=h2o",
        "--prompt",
        SHORT,
        "--max-new-tokens",
        "40",
        "--record",
        "attention",
        "--record-layers",
        "0,15,29",
        "--measure",
    ],
    "adakv-heads": [
        "--policy",
        "adakv",
        "--budget",
        "48",
        "--set",
        "base.window=16",
        "--prompt",
        SHORT,
        "--max-new-tokens",
        "24",
        "--record",
        "attention",
    ],  # every layer: the Head grid page's
    "kvmerger-attention": [
        "--policy",
        "kvmerger",
        "--prompt",
        SHORT,
        "--max-new-tokens",
        "24",
        "--record",
        "attention",
        "--record-layers",
        "0,15,29",
        "--measure",
    ],
}


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"unknown run {unknown[0]}; choose from: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    OUT.mkdir(exist_ok=True)
    for name in names or list(RUNS):
        cmd = [sys.executable, "-m", "kvlens", "generate", *RUNS[name], "--out", f"cached_runs/{name}"]
        print(f"run  {name}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        meta = read_meta(OUT / name)
        size = sum(f.stat().st_size for f in (OUT / name).iterdir())
        print(f"     {len(meta.tokens)} tokens, {size / 1e6:.2f} MB: {meta.text[:60]!r}")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"cached_runs/: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
