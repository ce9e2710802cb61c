"""One self-contained HTML report of recorded runs: what `kvlens report` writes and the app's Report button
gives.

For each run: its settings and the exact command that recorded it, its metrics, the figures of the analyses in
`FIGURES` whose needs it meets (their defaults: the middle recorded layer, head 0), the kept-text view at its
last step when it has attention rows (`kvlens.figures.kept_text`), and its evictions and merges per layer.
With two runs or more, a first section sets their settings and metrics side by side and overlays their
per-step curves (the `steps` analysis). plotly.js is inlined once and every figure drawn from it, so opening
the file fetches nothing: no external script, font or style sheet.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

import kvlens.figures.plots  # noqa: F401  (registers the "kvlens" plotly template the figures are drawn in)
from kvlens.analysis.registry import analysis_figure, get_analysis, lacks
from kvlens.errors import KvlensError
from kvlens.figures.kept_text import kept_text, kept_text_html
from kvlens.figures.plots import model_label, storage_label
from kvlens.figures.wording import layers_note, of_prompt, when
from kvlens.runs.decisions import counts, outcome
from kvlens.runs.run import Run, run_name
from kvlens.version import __version__

FIGURES = (
    "attention",
    "occupancy",
    "similarity",
    "perturbation",
    "perturbation-layers",
    "adjacency",
    "spectrum",
)
WIDE = {
    "attention",
    "perturbation",
    "perturbation-layers",
    "steps",
}  # drawn across the page, not in a half of it
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
METRICS = {  # run.json `metrics` keys the report names in words (any other scalar shows under its key)
    "ppl": "perplexity",
    "nll": "mean NLL (nats)",
    "kl": "KL(p_full ‖ p_policy), mean per step",
    "perturbation_used": "output perturbation (mean)",
    "perturbation_evict": "perturbation had it evicted (mean)",
    "attention_loss": "attention loss",
    "kv_slots_max": "most slots kept by a KV head",
    "kv_slots_final_mean": "slots per KV head at the end (mean)",
    "kv_bytes_peak": "peak KV cache",
    "kv_bytes_final": "KV cache at the end",
    "kv_bytes_prefill": "KV cache of the whole prompt",
    "ms_per_token": "ms per token",
    "prefill_ms": "prefill (ms)",
    "total_s": "wall time (s)",
}
STYLE = """
body{margin:0;background:#f6f7f9;color:#111;font:14px/1.5 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif}
main{max-width:1320px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;margin:0 0 2px}
h3{font-size:15px;margin:22px 0 8px;color:#333}
section{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:20px 24px;margin:20px 0}
.sub{color:#555;margin:0}.note{color:#8a5a00;font-size:13px}nav a{margin-right:14px;color:#0b5cad}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eceef1;padding:4px 12px 4px 0;
text-align:left;vertical-align:top}th{color:#555;font-weight:600}td.num,th.num{text-align:right;
font-variant-numeric:tabular-nums}code{font-size:12px;color:#666}
.cols{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:8px 24px}.wide{grid-column:1 / -1}
.scroll{overflow-x:auto}pre{white-space:pre-wrap;word-break:break-all;background:#f3f4f6;border-radius:6px;
padding:10px 12px;font-size:12px;margin:0}
"""


ANSWERS = {True: "right", False: "wrong"}  # whether the minimal set's answer is the full cache's


def report_html(runs: list[Run], explained: Sequence[dict] = ()) -> str:
    """The report of `runs` and of `explained` (`kvlens explain` results; at least one of either) as one HTML
    document (see module docstring)."""
    if not runs and not explained:
        raise KvlensError("A report needs at least one run or explain result.")
    names = [_name(run, i) for i, run in enumerate(runs)]
    whys = [
        f"why: {r['case']['policy']} "
        + (
            f"sample {r['case'].get('index')}"
            if r["case"]["source"] == "sample"
            else Path(r["case"]["run"]).name
        )
        for r in explained
    ]
    nav = "".join(
        f'<a href="#run-{i + 1}">{html.escape(name)}</a>' for i, name in enumerate(names)
    ) + "".join(f'<a href="#why-{i + 1}">{html.escape(name)}</a>' for i, name in enumerate(whys))
    body = [
        f'<h1>kvlens report</h1><p class="sub">{len(runs)} run{"s" * (len(runs) != 1)}'
        + when(explained, f", {len(explained)} explained")
        + f", written by kvlens {__version__}</p>"
        f"<nav>{nav}</nav>"
    ]
    if len(runs) > 1:
        body.append(_comparison(runs, names))
    body += [_run_section(run, name, i + 1) for i, (run, name) in enumerate(zip(runs, names))]
    body += [_why_section(result, name, i + 1) for i, (result, name) in enumerate(zip(explained, whys))]
    title = html.escape("kvlens report: " + ", ".join(names + whys))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style>'
        f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def checked_out(out: str | Path) -> Path:
    """`out` if a report can be written there (an .html file in an existing, writable folder), else one
    sentence."""
    out = Path(out)
    if out.is_dir():
        raise KvlensError(f"{out} is a folder; give a file name ending in .html.")
    if out.suffix.lower() not in (".html", ".htm"):
        raise KvlensError(f"--out must end in .html; got '{out.name}'.")
    if not out.parent.is_dir():
        raise KvlensError(f"The folder {out.parent} does not exist.")
    return out


def write_report(runs: list[Run], out: str | Path, explained: Sequence[dict] = ()) -> Path:
    """Write `report_html(runs, explained)` to `out` (checked by `checked_out`); the path written."""
    out = checked_out(out)
    text = report_html(runs, explained)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as err:
        raise KvlensError(f"Cannot write {out} ({err.strerror or err}).") from err
    return out


def _name(run: Run, i: int) -> str:
    return run_name(run, f"unsaved {run.meta.policy.name} run {i + 1}")


def _settings(run: Run) -> dict[str, str]:
    """The run's settings as table rows: policy, parameters, budget, storage, model, tokens, recording,
    sampling."""
    meta = run.meta
    params = meta.policy.params
    budget = meta.budget
    rec = meta.record
    shape = meta.model.shape
    rows = {
        "policy": meta.policy.name,
        "parameters": ", ".join(f"{k}={v}" for k, v in params.items()) or "none",
        "budget": "no budget"
        if budget.slots is None
        else f"{budget.slots} slots per KV head" + of_prompt(budget.requested),
    }
    if meta.storage and meta.storage.get("bits") is not None:
        rows["KV storage"] = storage_label(meta.storage)
    rows["model"] = (
        f"{model_label(meta.model.spec)} ({shape.get('layers')} layers, "
        f"{shape.get('heads')} query heads, {shape.get('kv_heads')} KV heads), "
        f"{meta.model.dtype or '?'} on {meta.model.device or '?'}"
    )
    rows["tokens"] = f"{meta.mode}: {len(meta.prompt_tokens)} prompt + {len(meta.tokens)} new"
    rows["recorded"] = (
        str(rec.level)
        + layers_note(rec.layers)
        + when(run.has("perturbation/used"), ", measured (--measure)")
    )
    rows["sampling"] = f"seed {meta.seed}, temperature {meta.temperature}, top-p {meta.top_p}"
    rows["kvlens"] = meta.kvlens_version or "?"
    return rows


def _value(key: str, value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.startswith("kv_bytes"):
        return f"{value / 2**20:.2f} MiB"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return "n/a" if math.isnan(value) else f"{value:#.4g}"


def _scalars(run: Run) -> dict:
    """The run's scalar metrics (per-layer lists are drawn by the figures instead)."""
    return {k: v for k, v in run.metrics.items() if not isinstance(v, (list, dict))}


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    """An HTML table; cells are HTML already (escape them first); columns from `numeric_from` on align
    right."""

    def cell(tag, i, text):
        attrs = when(i >= numeric_from, ' class="num"')
        return f"<{tag}{attrs}>{text}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _metric_label(key: str) -> str:
    return f"{html.escape(METRICS.get(key, key))} <code>{html.escape(key)}</code>"


def _figure(kind: str, source, div_id: str) -> str:
    """The registered analysis' figure as a plotly div (or the sentence saying why it could not be drawn)."""
    try:
        fig = analysis_figure(kind, source)
    except KvlensError as err:
        return f'<p class="note">{html.escape(kind)}: {html.escape(str(err))}</p>'
    return _plot(fig, div_id, kind in WIDE)


def _plot(fig: go.Figure, div_id: str, wide: bool) -> str:
    if (
        not fig.layout.template or not fig.layout.template.layout.font.family
    ):  # the analyses' own unstyled figures
        fig.update_layout(template="kvlens")
    fig.update_layout(width=None, template_layout_width=None, autosize=True)  # as wide as its column
    div = fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        include_mathjax=False,
        div_id=div_id,
        config=PLOTLY_CONFIG,
        default_width="100%",
    )
    return f'<div class="{"wide" if wide else "cell"}">{div}</div>'


def _decisions(run: Run) -> str:
    """Evictions and merges per layer (summed over KV heads and steps) as a small table."""
    d = run.decisions
    if d is None or not len(d):
        return '<p class="sub">No evictions or merges: the cache was never compressed.</p>'
    layers = list(range(int(run.shape["layers"])))
    left = outcome(d)
    kinds = {"evicted": d[left == "evicted"], "merged": d[left == "merged"]}
    if counts(d).drew_zero:
        kinds["of the evicted: merges whose Bernoulli draw was 0 (they moved nothing)"] = d[
            (d["action"] == "merge") & (d["draw"] == 0)
        ]
    rows = []
    for label, rows_of in kinds.items():
        per_layer = rows_of.groupby("layer").size()
        rows.append([label, *(f"{int(per_layer.get(n, 0)):,}" for n in layers), f"{len(rows_of):,}"])
    return (
        '<p class="sub">Decisions per layer, summed over KV heads and steps (a merge folds one position into '
        "others).</p>" + _table(["layer", *map(str, layers), "total"], rows)
    )


def _text(run: Run) -> str:
    """The prompt (grey) and the generated text, for runs without attention rows."""
    return (
        f'<div style="white-space:pre-wrap;line-height:1.6"><span style="color:#777">'
        f'{html.escape(run.meta.prompt)}</span><span style="background:#e8f0fe">'
        f"{html.escape(run.meta.text)}</span></div>"
    )


def _kept_text(run: Run) -> str:
    """The kept-text view at the run's last step, or its plain text and the sentence saying why not."""
    try:
        steps = len(run.meta.tokens)
        return kept_text_html(kept_text(run, steps - 1))
    except KvlensError as err:
        return f'<p class="note">{html.escape(str(err))}</p>{_text(run)}'


def _command(command: str | None) -> str:
    """The command that made a run or a result, as a block; nothing when it records none."""
    return when(command, f"<pre>{html.escape(str(command))}</pre>")


def _run_section(run: Run, name: str, number: int) -> str:
    settings = _settings(run)
    rows = [[html.escape(k), html.escape(v)] for k, v in settings.items()]
    command = run.meta.command
    metrics = [[_metric_label(k), html.escape(_value(k, v))] for k, v in _scalars(run).items()]
    figures = [
        _figure(kind, run, f"run{number}-{kind}")
        for kind in FIGURES
        if lacks(get_analysis(kind), run) is None
    ]
    return (
        f'<section id="run-{number}"><h2>{number}. {html.escape(name)}</h2>'
        f'<p class="sub">{html.escape(settings["policy"])} · {html.escape(settings["budget"])} · '
        f"{html.escape(settings['tokens'])} tokens</p>"
        f"<h3>Settings</h3>{_table(['setting', 'value'], rows, numeric_from=2)}"
        "<h3>Command</h3>"
        + (_command(command) or '<p class="sub">run.json records no command.</p>')
        + "<h3>Metrics</h3>"
        + (when(metrics, _table(["metric", "value"], metrics)) or "<p>No metrics.</p>")
        + f"<h3>Text and the cache at the last step</h3>{_kept_text(run)}"
        f"<h3>Evictions and merges</h3>{_decisions(run)}"
        f'<h3>Figures</h3><div class="cols">{"".join(figures)}</div></section>'
    )


def _why_section(result: dict, name: str, number: int) -> str:
    """A `kvlens explain` result: its case, the log-probability gap, both ends, the minimal set and the Why
    page's figures (`kvlens.figures.why`)."""
    from kvlens.figures.why import figures

    rows = [[html.escape(k), html.escape(str(v))] for k, v in result["case"].items()]
    rows += [
        ["log-probability (full, compressed)", f"{result['lp_full']:.2f}, {result['lp_compressed']:.2f}"],
        ["entries removed", f"{result['slots_removed']:,}"],
        [
            "recovered share: all groups, none",
            f"{result['all_groups']['recovered_share']:.3f}, {result['no_groups']['recovered_share']:.3f}",
        ],
        [
            "cost",
            f"{result['cost']['patched_caches']} patched caches, {result['cost']['total_s']:.1f} s on "
            f"{result['cost']['threads']} thread(s)",
        ],
    ]
    m = result.get("minimal")
    if m and m["found"]:
        rows.append(
            [
                "smallest sufficient set",
                html.escape(
                    f"{len(m['groups'])} {m['by']} groups ({', '.join(m['groups'])}), "
                    f"{m['slots']:,} slots in layers "
                    f"{', '.join(map(str, m['layers']))}; recovers {m['recovered_share']:.2f} of the gap"
                    + when("right" in m, f"; answer {ANSWERS.get(m.get('right'))}")
                ),
            ]
        )
    command = result.get("command")
    plots = [
        _plot(fig, f"why{number}-{view}", True)
        if not isinstance(fig, str)
        else f'<p class="note">{html.escape(fig)}</p>'
        for view, fig in figures(result).items()
    ]
    return (
        f'<section id="why-{number}"><h2>Why {number}. {html.escape(name)}</h2>'
        f"<h3>Case and result</h3>{_table(['', 'value'], rows, numeric_from=2)}"
        + when(command, "<h3>Command</h3>" + _command(command))
        + f'<h3>Figures</h3><div class="cols">{"".join(plots)}</div></section>'
    )


def _comparison(runs: list[Run], names: list[str]) -> str:
    """Every run's settings and scalar metrics side by side, and their per-step curves overlaid."""
    settings = [_settings(run) for run in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    rows = [[html.escape(k), *(html.escape(s.get(k, "")) for s in settings)] for k in keys]
    scalars = [_scalars(run) for run in runs]
    metrics = list(dict.fromkeys(k for s in scalars for k in s))
    values = [
        [_metric_label(k), *(html.escape(_value(k, s[k])) if k in s else "–" for s in scalars)]
        for k in metrics
    ]
    header = [f'<a href="#run-{i + 1}">{html.escape(n)}</a>' for i, n in enumerate(names)]
    return (
        f'<section id="comparison"><h2>The {len(runs)} runs side by side</h2>'
        f"<h3>Settings</h3>{_table(['setting', *header], rows, numeric_from=len(runs) + 1)}"
        f"<h3>Metrics</h3>{_table(['metric', *header], values)}"
        f'<h3>Per step</h3><div class="cols">{_figure("steps", runs, "comparison-steps")}</div></section>'
    )
