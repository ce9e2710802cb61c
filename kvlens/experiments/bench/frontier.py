"""The bytes-quality frontier: eviction, merging, quantized and low-rank storage, and mixes, at equal physical
bytes.

At each byte budget b (a share of the full cache's bytes in the model's dtype at the last step),
`plan_frontier` makes `ppl` cells (`kvlens.experiments.sweep.ppl_cell`, teacher-forced perplexity on bundled
texts) of:
- eviction alone and merging alone: the policy at b of the slots, in the model's dtype;
- quantization alone: every slot (`full`) at each of `bits` (its share is what the bits cost, not b);
- low rank alone (`kvlens.kvcache.lowrank`, `--kv-rank-share b`: the largest rank whose bytes, bases included,
  fit in b): every slot (`full`) per KV head with later tokens projected (Palu-style) or at full width, and
  across groups of `rank_layers` adjacent layers (xKV) with later tokens at full width (so that xKV and
  per-head rank differ only in the sharing);
- mixes: the mix policy at b / q(bits) of the slots, stored at `bits`, for the bits where that share is below
  1 (q(bits) = bits / model bits + the zero points' and scales' share, `slot_cost`); the mix policy at sqrt(b)
  of the slots stored per head at rank share sqrt(b) (the two axes halving the bytes alike); and every slot at
  rank share b with 4-bit coefficients (Palu's quantized latents); plus the full cache itself once per text
  (the reference every share and ratio is taken against). Each row's `bytes_share` is measured: its
  `kv_bytes_peak` over the full cache's on the same text.

`plan_frontier_tasks` adds the same configurations as task cells (`kvlens.experiments.bench.tasks`:
RULER-style samples, the context compressed once, the question appended; one shared prefill per sample and
storage), at compression ratio 1 - b (mixes: 1 - b / q(bits)); their `bytes_share` is the compressed context's
physical bytes over the full cache's on the same sample, and their quality the task score.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from kvlens.errors import KvlensError
from kvlens.experiments.bench import tasks as task_suite
from kvlens.experiments.bench.common import PolicySpec, bootstrap, mean, spread
from kvlens.experiments.sweep import plan_ppl
from kvlens.figures.wording import suffix
from kvlens.kvcache.quantize import Storage

FAMILIES = ("eviction", "merging", "quantization", "low_rank", "mix")
_FAMILY_ORDER = {family: i for i, family in enumerate(FAMILIES)}  # any other family (the reference): first


def slot_cost(storage: Storage, model_bits: int = 32) -> float:
    """Bytes of a slot stored this way over the model's dtype: codes plus a float16 zero point and scale per
    `group` values (the full-precision window not counted)."""
    return (storage.bits + 32 / storage.group) / model_bits


def _at_bits(storage: Storage, bits: int) -> dict:
    """`storage` at `bits`, described (a cell's `storage`)."""
    return dataclasses.replace(storage, bits=bits).describe()


def plan_frontier(
    byte_shares: list[float],
    texts: dict[str, str],
    *,
    prefill: int,
    tokens: int,
    model: str,
    evictors: list[tuple[str, dict]],
    mergers: list[tuple[str, dict]],
    bits: list[int],
    mix: tuple[str, dict] | None,
    mix_bits: list[int],
    storage: Storage,
    low_rank: bool = True,
    rank_layers: int | None = 4,
) -> list[dict]:
    """The frontier's cells (see the module docstring); `storage` gives the scheme, group and window of
    every quantized cell; `low_rank`: the low-rank cells too (`rank_layers`: xKV's group of layers, None:
    no xKV)."""
    if not byte_shares or min(byte_shares) <= 0 or max(byte_shares) >= 1:
        raise KvlensError(
            "--byte-shares must be shares of the full cache between 0 and 1 (e.g. 0.5,0.25,0.125)."
        )
    cached = prefill + tokens - 1  # slots of the full cache at the last step

    def slots(share: float) -> int:
        return max(1, round(share * cached))

    def cells(family, policies, budgets, target=None, described=None):
        out = plan_ppl(policies, budgets, texts, [prefill], tokens=tokens, model=model)
        return [{**c, "family": family, "storage": described, "target": target} for c in out]

    plan = cells("reference", [("full", {})], [None])
    for b in byte_shares:
        for family, policies in (("eviction", evictors), ("merging", mergers)):
            if policies:
                plan += cells(family, policies, [slots(b)], target=b)
        for k in mix_bits * bool(mix):
            share = b / slot_cost(dataclasses.replace(storage, bits=k))
            if share < 1:
                plan += cells("mix", [mix], [slots(share)], target=b, described=_at_bits(storage, k))
        for family, policy, kept, ranked in low_rank_cells(b, mix, rank_layers) * low_rank:
            plan += cells(
                family, [policy], [None if kept == 1 else slots(kept)], target=b, described=ranked.describe()
            )
    for k in bits:
        plan += cells("quantization", [("full", {})], [None], described=_at_bits(storage, k))
    return plan


def low_rank_cells(
    b: float, mix: tuple[str, dict] | None, rank_layers: int | None
) -> list[tuple[str, tuple[str, dict], float, Storage]]:
    """The low-rank configurations at byte share `b`: (family, policy, share of the slots kept, storage)."""
    full = ("full", {})
    out = [
        ("low_rank", full, 1.0, Storage(rank_share=b)),
        ("low_rank", full, 1.0, Storage(rank_share=b, rank_append="full")),
    ]
    if rank_layers:
        out.append(
            ("low_rank", full, 1.0, Storage(rank_share=b, rank_layers=rank_layers, rank_append="full"))
        )
    if mix:
        out.append(("mix", mix, math.sqrt(b), Storage(rank_share=round(math.sqrt(b), 4))))
    return out + [("mix", full, 1.0, Storage(rank_share=b, bits=4))]


def plan_frontier_tasks(
    byte_shares: list[float],
    *,
    tasks: list[str],
    lengths: list[int],
    count: int,
    seed: int,
    source: str,
    model: str,
    evictors: list[tuple[str, dict]],
    mergers: list[tuple[str, dict]],
    bits: list[int],
    mix: tuple[str, dict] | None,
    mix_bits: list[int],
    storage: Storage,
    low_rank: bool = True,
    rank_layers: int | None = 4,
) -> list[dict]:
    """The frontier's task cells (see the module docstring): per sample, one cell in the model's dtype
    (eviction and merging) and one per bits (the full cache, quantization alone, and the mix); the full cache
    in the model's dtype is in the first, as the reference."""

    def spec(name: str, params: dict) -> PolicySpec:
        return PolicySpec(name, tuple(sorted(params.items())))

    mergers_ = [spec(*p).label for p in mergers]

    def cells(policies, ratios, described=None):
        out = task_suite.plan_tasks(
            policies,
            ratios,
            tasks,
            lengths,
            count,
            model=model,
            seed=seed,
            query_aware=False,
            chat=True,
            source=source,
        )
        return [{**c, "storage": described, "mergers": mergers_} for c in out]

    mix_bits = mix_bits * bool(mix)  # no mix, no mix cells
    plan = cells([spec(*p) for p in evictors + mergers], [1 - b for b in byte_shares])
    for k in sorted(set(bits) | set(mix_bits), reverse=True):
        cost = slot_cost(dataclasses.replace(storage, bits=k))
        ratios = [1 - b / cost for b in byte_shares if b / cost < 1 and k in mix_bits]
        plan += cells(
            [spec(*mix)] if ratios else [], ratios, _at_bits(storage, k)
        )  # the full cache at k bits is always in a cell
    for b in byte_shares * low_rank:  # a cell per storage: its policy, or the full cache alone
        for _, policy, kept, ranked in low_rank_cells(b, mix, rank_layers):
            evicting = kept < 1
            plan += cells([spec(*policy)] * evicting, [1 - kept] * evicting, ranked.describe())
    return plan


def _task_records(rows: list[dict]) -> list[dict]:
    """One record per (sample, policy, ratio, bits) of the task cells, with its family, byte budget and bytes
    share (over the full cache's in the model's dtype on the same sample)."""
    records = []
    for row in rows:
        storage = Storage.of(row.get("storage"))
        for res in row["results"]:
            records.append(
                {
                    **res,
                    "family": _family(res["policy"], storage, row["mergers"]),
                    "bits": storage.bits,
                    "storage": row.get("storage"),
                    "cost": _cost(storage),
                    "sample": (row["suite_task"], row["length"], row["index"]),
                }
            )
    full = {r["sample"]: r["kv_bytes"] for r in records if r["family"] == "reference"}
    records = [r for r in records if r["sample"] in full]
    for r in records:
        r["bytes_share"] = r["kv_bytes"] / full[r["sample"]]
        kept = 1 - (r["ratio"] or 0)
        r["target"] = None if r["family"] in ("reference", "quantization") else round(kept * r["cost"], 4)
    return records


def _cost(storage: Storage) -> float:
    """Bytes of a kept slot over the model's dtype's, as planned: the rank share, or what quantization
    costs."""
    if storage.low_rank:
        return storage.rank_share
    if storage.quantized:
        return slot_cost(storage)
    return 1.0


_STORED_FAMILIES = {  # the full cache (policy "full"), low rank, quantized -> family; any other: "mix"
    (True, True, False): "low_rank",
    (True, False, True): "quantization",
    (True, False, False): "reference",
}


def _family(policy: str, storage: Storage, mergers: list[str]) -> str:
    """A task result's family: how its bytes were saved."""
    if policy != "full" and not storage.packed:
        return "merging" if policy in mergers else "eviction"
    return _STORED_FAMILIES.get((policy == "full", storage.low_rank, storage.quantized), "mix")


def summarise_tasks(rows: list[dict]) -> list[dict]:
    """Per configuration over the task samples: bytes share (mean), the score (mean over tasks and lengths)
    with a bootstrap 95 % interval over samples, and the full cache's score on the same samples."""
    records = _task_records(rows)
    groups: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in records:
        config = r["policy"] if r["policy"] == "full" else f"{r['policy']} r={r['ratio']:.3g}"
        config = _stored(config, r["storage"])
        groups.setdefault(
            (r["family"], config, r["target"], _series(r["family"], r["policy"], r["storage"])), {}
        ).setdefault(r["sample"][:2], []).append(r)
    full = mean(r["score"] for r in records if r["family"] == "reference")  # records: only samples with one
    out = []
    for (family, config, target, series), by_task in groups.items():
        scores = [[r["score"] for r in g] for g in by_task.values()]
        low, high = bootstrap(scores)
        every = [r for g in by_task.values() for r in g]
        out.append(
            {
                "family": family,
                "config": config,
                "series": series,
                "target": target,
                "metric": "score",
                "bytes_share": statistics.fmean(r["bytes_share"] for r in every),
                "score": statistics.fmean(statistics.fmean(g) for g in scores),
                "ci_low": low,
                "ci_high": high,
                "samples": len(every),
                "full_score": full,
            }
        )
    return _ordered(out)


def _ordered(summary: list[dict]) -> list[dict]:
    return sorted(
        summary,
        key=lambda s: (_FAMILY_ORDER.get(s["family"], -1), -s["bytes_share"]),
    )


def _rank_kind(storage: dict) -> str:
    """Low-rank storage in words: per head (later tokens projected, or at full width), or xKV's groups of
    layers."""
    if storage.get("rank_layers"):
        return f"xKV low rank, {storage['rank_layers']} layers"
    return "low rank per head" + {"full": ", full-width new tokens"}.get(storage.get("rank_append"), "")


def _series(family: str, policy: str, storage: dict | None) -> str:
    """The line a configuration belongs to in the figure: its policy and storage across byte budgets
    (quantization alone: one line across its bits)."""
    storage = storage or {}
    if family == "quantization":
        return "all slots"
    name = "all slots" if policy == "full" and family != "reference" else policy
    if storage.get("rank_share") is not None:
        name += f", {_rank_kind(storage)}"
    return name + suffix(" @ {} bits", storage.get("bits"))


def _stored(name: str, storage: dict | None) -> str:
    """A configuration's name (`name`: its policy and budget) with its storage."""
    storage = storage or {}
    ranked, bits = storage.get("rank_share") is not None, storage.get("bits")
    if name == "full" and (bits or ranked):
        name = "all slots"
    if ranked:
        name += f", {_rank_kind(storage)} at {storage['rank_share']:g} of its bytes"
        return name + suffix(" @ {}-bit coefficients", bits)
    return name + suffix(" @ {} bits", bits)


def _config(row: dict) -> str:
    name = row["policy"]
    if row["budget_slots"] is not None and row["policy"] != "full":
        name += f" {row['budget_slots']} slots"
    return _stored(name, row.get("storage"))


def summarise(rows: list[dict]) -> list[dict]:
    """The perplexity cells' summary (`summarise_ppl`), then the task cells' (`summarise_tasks`), if any."""
    scored = [r for r in rows if r.get("task") == "tasks"]
    return summarise_ppl([r for r in rows if r.get("task") != "tasks"]) + summarise_tasks(scored)


def summarise_ppl(rows: list[dict]) -> list[dict]:
    """Per configuration: bytes share (mean over texts), perplexity mean/std/min/max over texts, and the mean
    perplexity ratio to the full cache on the same texts."""
    full = {r["text"]: r for r in rows if r.get("family") == "reference"}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["text"] in full:
            series = _series(row.get("family"), row["policy"], row.get("storage"))
            groups.setdefault((row.get("family"), _config(row), row.get("target"), series), []).append(row)
    out = []
    for (family, config, target, series), group in groups.items():
        p = spread(r["ppl"] for r in group)
        share = spread(r["kv_bytes_peak"] / full[r["text"]]["kv_bytes_peak"] for r in group)
        ratio = spread(r["ppl"] / full[r["text"]]["ppl"] for r in group)
        out.append(
            {
                "family": family,
                "config": config,
                "series": series,
                "target": target,
                "metric": "ppl",
                "bytes_share": share["mean"],
                "ppl": p["mean"],
                "ppl_std": p["std"],
                "ppl_min": p["min"],
                "ppl_max": p["max"],
                "ppl_vs_full": ratio["mean"],
                "ppl_vs_full_min": ratio["min"],
                "ppl_vs_full_max": ratio["max"],
                "texts": p["n"],
            }
        )
    return _ordered(out)


def table(summary: list[dict]) -> str:
    """The summary as Markdown tables: perplexity, then task score (when the frontier has task cells)."""
    lines = [
        "| family | configuration | bytes (share of full) | perplexity (mean, min-max over "
        "texts) | vs full |",
        "|---|---|---|---|---|",
    ]
    for s in summary:
        if s["metric"] == "ppl":
            lines.append(
                f"| {s['family']} | {s['config']} | {s['bytes_share']:.3f} | {s['ppl']:.2f} "
                f"({s['ppl_min']:.2f}-{s['ppl_max']:.2f}) | {s['ppl_vs_full']:.3f} |"
            )
    scored = [s for s in summary if s["metric"] == "score"]
    if scored:
        lines += [
            "",
            "| family | configuration | bytes (share of full) | task score [95 % interval] | samples |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['family']} | {s['config']} | {s['bytes_share']:.3f} | {s['score']:.1%} "
            f"[{s['ci_low']:.0%}, {s['ci_high']:.0%}] | {s['samples']} |"
            for s in scored
        ]
    return "\n".join(lines)


def figure(result: dict):
    """Quality against physical bytes (log scale), a line per policy and storage (colour: its family):
    perplexity over the full cache's on the same text (bars: min-max over texts) and, with task cells, the
    task score (bars: bootstrap 95 % intervals over samples) beside it."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from kvlens.figures.plots import DASHES, SYMBOLS  # also registers the "kvlens" paper template

    summary = result.get("summary") or summarise(result["rows"])
    panels = [m for m in ("ppl", "score") if any(s["metric"] == m for s in summary)]
    c = result["config"]
    titles = {"ppl": "perplexity ÷ the full cache's", "score": "task score"}
    y_titles = {"ppl": "perplexity / full", "score": "score"}
    columns = {  # the value, and its bar's ends
        "ppl": ("ppl_vs_full", "ppl_vs_full_min", "ppl_vs_full_max"),
        "score": ("score", "ci_low", "ci_high"),
    }
    details = {
        "ppl": f"perplexity: {c['prefill']} prompt + {c['tokens']} tokens, {len(c['texts'])} texts "
        "(bars: min-max over texts)",
        "score": f"task score: {', '.join(c.get('tasks') or [])}, {c.get('task_count')} samples each "
        "(bars: 95 % intervals)",
    }
    fig = make_subplots(
        rows=1, cols=len(panels), subplot_titles=[titles[m] for m in panels], horizontal_spacing=0.08
    )
    colors = dict(zip(FAMILIES, ["#222222", "#0072B2", "#D55E00", "#CC79A7", "#009E73"], strict=True))
    for col, metric in enumerate(panels, 1):
        y, low, high = columns[metric]
        rows = [s for s in summary if s["metric"] == metric]
        for family in FAMILIES:
            lines = list(dict.fromkeys(s.get("series", s["config"]) for s in rows if s["family"] == family))
            for j, series in enumerate(lines):
                points = sorted(
                    (s for s in rows if s["family"] == family and s.get("series", s["config"]) == series),
                    key=lambda s: s["bytes_share"],
                )
                name = f"{series} ({family})"
                fig.add_trace(
                    go.Scatter(
                        x=[s["bytes_share"] for s in points],
                        y=[s[y] for s in points],
                        name=name,
                        legendgroup=name,
                        showlegend=col == 1,
                        mode="lines+markers",
                        text=[s["config"] for s in points],
                        hovertemplate="%{text}<br>bytes %{x:.3f}<br>%{y:.3f}<extra>" + family + "</extra>",
                        line=dict(color=colors[family], dash=DASHES[j % len(DASHES)], width=2),
                        marker=dict(color=colors[family], symbol=SYMBOLS[j % len(SYMBOLS)], size=7),
                        error_y={
                            "type": "data",
                            "symmetric": False,
                            "array": [s[high] - s[y] for s in points],
                            "arrayminus": [s[y] - s[low] for s in points],
                            "thickness": 1,
                        },
                    ),
                    1,
                    col,
                )
        fig.add_hline(y=1.0, line_dash="dot", line_color="#555", annotation_text="full cache", row=1, col=col)
        fig.update_xaxes(title_text="KV cache bytes, share of the full cache", type="log", row=1, col=col)
        fig.update_yaxes(title_text=y_titles[metric], row=1, col=col)
    fig.update_layout(
        title=dict(
            text="Quality against KV bytes, a colour per family"
            + "".join(f"<br><sup>{details[m]}</sup>" for m in panels),
            yref="container",
            y=0.98,
            yanchor="top",
        ),
        width=760 * len(panels) + 240,
        height=580,
        margin=dict(t=150),
        template="kvlens",
    )
    return fig
