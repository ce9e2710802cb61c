"""The bytes-quality frontier: eviction, merging and quantized storage, and their mixes, at equal physical bytes.

At each byte budget b (a share of the full cache's bytes in the model's dtype at the last step), `plan_frontier`
makes `ppl` cells (`kvlens.experiments.sweep.ppl_cell`, teacher-forced perplexity on bundled texts) of:
- eviction alone and merging alone: the policy at b of the slots, in the model's dtype;
- quantization alone: every slot (`full`) at each of `bits` (its share is what the bits cost, not b);
- mixes: the mix policy at b / q(bits) of the slots, stored at `bits`, for the bits where that share is below
  1 (q(bits) = bits / model bits + the zero points' and scales' share, `slot_cost`);
plus the full cache itself once per text (the reference every share and ratio is taken against). Each row's
`bytes_share` is measured: its `kv_bytes_peak` over the full cache's on the same text.
"""
from __future__ import annotations

from kvlens.engine.quantize import Storage
from kvlens.errors import KvlensError
from kvlens.experiments.bench.common import spread
from kvlens.experiments.sweep import plan_ppl

FAMILIES = ("eviction", "merging", "quantization", "mix")


def slot_cost(storage: Storage, model_bits: int = 32) -> float:
    """Bytes of a slot stored this way over the model's dtype: codes plus a float16 zero point and scale per
    `group` values (the full-precision window not counted)."""
    return (storage.bits + 32 / storage.group) / model_bits


def plan_frontier(byte_shares: list[float], texts: dict[str, str], *, prefill: int, tokens: int, model: str,
                  evictors: list[tuple[str, dict]], mergers: list[tuple[str, dict]], bits: list[int],
                  mix: tuple[str, dict] | None, mix_bits: list[int], storage: Storage) -> list[dict]:
    """The frontier's cells (see the module docstring); `storage` gives the scheme, group and window of every
    quantized cell."""
    if not byte_shares or min(byte_shares) <= 0 or max(byte_shares) >= 1:
        raise KvlensError("--byte-shares must be shares of the full cache between 0 and 1 (e.g. 0.5,0.25,0.125).")
    cached = prefill + tokens - 1  # slots of the full cache at the last step

    def slots(share: float) -> int:
        return max(1, round(share * cached))

    def cells(family, policies, budgets, bits_=None, target=None):
        out = plan_ppl(policies, budgets, texts, [prefill], tokens=tokens, model=model)
        described = Storage(bits_, storage.scheme, storage.group, storage.residual).describe() if bits_ else None
        return [{**c, "family": family, "storage": described, "target": target} for c in out]

    plan = cells("reference", [("full", {})], [None])
    for b in byte_shares:
        plan += cells("eviction", evictors, [slots(b)], target=b) if evictors else []
        plan += cells("merging", mergers, [slots(b)], target=b) if mergers else []
        for k in mix_bits if mix else []:
            share = b / slot_cost(Storage(k, storage.scheme, storage.group, storage.residual))
            if share < 1:
                plan += cells("mix", [mix], [slots(share)], k, target=b)
    for k in bits:
        plan += cells("quantization", [("full", {})], [None], k)
    return plan


def _config(row: dict) -> str:
    bits = (row.get("storage") or {}).get("bits")
    name = row["policy"] if row["policy"] != "full" or not bits else "all slots"
    if row["budget_slots"] is not None and row["policy"] != "full":
        name += f" {row['budget_slots']} slots"
    return name + (f" @ {bits} bits" if bits else "")


def summarise(rows: list[dict]) -> list[dict]:
    """Per configuration: bytes share (mean over texts), perplexity mean/std/min/max over texts, and the mean
    perplexity ratio to the full cache on the same texts."""
    full = {r["text"]: r for r in rows if r.get("family") == "reference"}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["text"] in full:
            groups.setdefault((row.get("family"), _config(row), row.get("target")), []).append(row)
    out = []
    for (family, config, target), group in groups.items():
        p = spread(r["ppl"] for r in group)
        share = spread(r["kv_bytes_peak"] / full[r["text"]]["kv_bytes_peak"] for r in group)
        ratio = spread(r["ppl"] / full[r["text"]]["ppl"] for r in group)
        out.append({"family": family, "config": config, "target": target, "bytes_share": share["mean"],
                    "ppl": p["mean"], "ppl_std": p["std"], "ppl_min": p["min"], "ppl_max": p["max"],
                    "ppl_vs_full": ratio["mean"], "ppl_vs_full_min": ratio["min"], "ppl_vs_full_max": ratio["max"],
                    "texts": p["n"]})
    return sorted(out, key=lambda s: (FAMILIES.index(s["family"]) if s["family"] in FAMILIES else -1,
                                      -s["bytes_share"]))


def table(summary: list[dict]) -> str:
    lines = ["| family | configuration | bytes (share of full) | perplexity (mean, min-max over texts) | vs full |",
             "|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['family']} | {s['config']} | {s['bytes_share']:.3f} | {s['ppl']:.2f} "
                     f"({s['ppl_min']:.2f}-{s['ppl_max']:.2f}) | {s['ppl_vs_full']:.3f} |")
    return "\n".join(lines)


def figure(result: dict):
    """Perplexity against physical bytes (log scale), one line per family; error bars: min-max over texts."""
    import plotly.graph_objects as go

    from kvlens.figures.plots import line_style  # also registers the "kvlens" paper template

    summary = result.get("summary") or summarise(result["rows"])
    fig = go.Figure()
    full = [s for s in summary if s["family"] == "reference"]
    for i, family in enumerate(FAMILIES):
        points = sorted((s for s in summary if s["family"] == family), key=lambda s: s["bytes_share"])
        if not points:
            continue
        fig.add_trace(go.Scatter(
            x=[s["bytes_share"] for s in points], y=[s["ppl"] for s in points], name=family,
            mode="lines+markers", text=[s["config"] for s in points], hovertemplate="%{text}<br>bytes %{x:.3f}"
            "<br>ppl %{y:.2f}<extra>" + family + "</extra>",
            error_y={"type": "data", "symmetric": False, "array": [s["ppl_max"] - s["ppl"] for s in points],
                     "arrayminus": [s["ppl"] - s["ppl_min"] for s in points]}, **line_style(i)))
    if full:
        fig.add_hline(y=full[0]["ppl"], line_dash="dot", annotation_text="full cache", line_color="#555")
    c = result["config"]
    fig.update_layout(title=f"Perplexity against KV bytes ({c['prefill']} prompt + {c['tokens']} scored tokens, "
                            f"{len(c['texts'])} texts; bars: min-max over texts)",
                      xaxis={"title": "KV cache bytes, share of the full cache", "type": "log"},
                      yaxis_title="perplexity", width=900, height=520, template="kvlens")
    return fig
