"""docs/analyses.md: every analysis kind from the analysis registry (`kvlens/analysis/registry.py`), with the
example figure exported by `kvlens figure` into docs/img/ where one exists (its JSON names the command)."""

from __future__ import annotations

import inspect
import json
import sys

from docgen.common import ROOT, banner, table

INPUTS = {
    "run": "one run (`--run DIR`)",
    "runs": "several runs (`--run DIR` repeated)",
    "model": "the model, over the bundled texts",
}


def examples() -> dict[str, list[tuple[str, str]]]:
    """Analysis name -> [(image file name, the `kvlens figure` command that made it)] from docs/img/*.json."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in sorted((ROOT / "docs" / "img").glob("*.json")):
        meta = json.loads(path.read_text(encoding="utf-8"))
        image = path.with_suffix(".png")
        if isinstance(meta, dict) and meta.get("analysis") and image.exists():
            out.setdefault(meta["analysis"], []).append((image.name, meta.get("command", "")))
    return out


def section(name: str, cls, shown: dict) -> str:
    module = inspect.getdoc(sys.modules[cls.__module__]) or ""
    out = f"## {name}\n\n**Reproduces**: {cls.paper}. **Reads**: {INPUTS[cls.inputs]}"
    if cls.inputs != "model":
        out += f", recorded with `--record {cls.level}` or more" + (
            " and `--measure`" if cls.measured else ""
        )
    if cls.replays:
        out += "; it feeds the run's tokens through the run's model again (`--device`, `--dtype`)"
    out += f".\n\n{module}\n\n" + (f"{cls.see_also}\n\n" if cls.see_also else "")
    rows = [
        [f"`--{p.name.replace('_', '-')}`", f"`{p.describe()['default']}`", p.describe()["help"]]
        for p in cls.params
    ]
    out += (table(["flag", "default", "what it sets"], rows) if rows else "No parameters.\n") + "\n"
    if cls.inputs == "model":
        out += f"```\nkvlens analyze {name} --json\nkvlens figure {name} --out {name}.png\n```\n\n"
    else:
        out += (
            f"```\nkvlens analyze {name} --run DIR --json\n"
            f"kvlens figure {name} --run DIR --out {name}.png\n```\n\n"
        )
    for image, command in shown.get(name, []):
        out += f"![{name}](img/{image})\n\n*Made by `{command}`.*\n\n"
    return out


def page() -> str:
    from kvlens.analysis.registry import analyses

    kinds = analyses()
    shown = examples()
    out = banner("the analysis registry (`kvlens.analysis.registry.analyses()`)") + "# Analyses\n\n"
    out += (
        "An analysis reads recorded runs (or runs the model) and gives numbers (`kvlens analyze "
        "KIND --json`, "
        "`Run.analyze(KIND)`) and a figure (`kvlens figure KIND --out FILE` writes it with its "
        "data as CSV and "
        "its settings as JSON; `Run.figure(KIND)` returns the plotly figure; the app's Analyses "
        "page draws it "
        "with a widget per parameter).\n\n"
    )
    out += (
        "The analyses of a run's prompt recompute attention from the recorded float16 prefill "
        "queries and keys "
        "(float32 math), so they need `--record states`; the softmax scale is 1/sqrt(head_dim). Spectra are "
        "not centred (as WeightedKV); above 512 tokens or dimensions they use scikit-learn's seeded "
        "randomized SVD with the total energy from the Frobenius norm.\n\n"
    )
    out += (
        table(
            ["kind", "reproduces", "reads"],
            [[f"[`{n}`](#{n})", c.paper, INPUTS[c.inputs]] for n, c in kinds.items()],
        )
        + "\n"
    )
    for name, cls in kinds.items():
        out += section(name, cls, shown)
    return out


def names() -> list[str]:
    from kvlens.analysis.registry import analyses

    return list(analyses())
