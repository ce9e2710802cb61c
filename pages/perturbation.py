"""Perturbation: merge vs evict output perturbation over steps and layers, attention loss, KL (CaM Fig. 1d);
with quantized storage, the output error split into the choice of positions, quantized storage and merging."""

import streamlit as st

from kvlens.figures.perturbation_sources import PARTS, has_sources, shares, sources_figure
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, meets
from kvlens.ui.results import sweep_section
from kvlens.ui.state import run_figure

run = browse_page(
    "Perturbation",
    "How far attention outputs drift from the full cache: the cache actually used, the "
    "same evictions without merging, the attention mass lost, and the KL of the "
    "next-token distribution.",
)
if meets(analysis_need("perturbation"), "pert_offer"):
    if run.tensor("perturbation/used").shape[0] == 0:
        st.info("This run produced a single token, so no decode step was measured.")
    else:
        m = run.metrics
        quantized = has_sources(run)
        evict = "Perturbation (evict only, full precision)" if quantized else "Perturbation (evict only)"
        for col, (label, key) in zip(
            st.columns(4),
            [
                ("Perturbation (cache used)", "perturbation_used"),
                (evict, "perturbation_evict"),
                ("Attention loss", "attention_loss"),
                ("KL to full", "kl"),
            ],
            strict=True,
        ):
            col.metric(label, f"{m[key]:.4f}")
        if quantized:
            st.subheader("Where the output error comes from")
            st.caption(
                "The cache used's output error, pooled over steps, layers and heads (sum ‖O − O_full‖ / "
                "sum ‖O_full‖, so that the parts add up; the means above weigh every cell alike), split into "
                "the choice of positions (the same positions in full precision), what quantized storage "
                "adds, and what merging adds."
            )
            src, part = m["perturbation_sources"], shares(m["perturbation_sources"])
            helps = {
                "selection": "The same positions in full precision: the error of choosing what to keep.",
                "storage": "What quantizing the kept keys and values adds (same positions, no merging).",
                "merging": "What the policy's merges add on top; negative when merging brings the output "
                "closer to the full cache's.",
            }
            cols = st.columns(len(PARTS) + 1)
            for col, (key, label, _) in zip(cols, PARTS, strict=False):
                col.metric(
                    label.capitalize(),
                    f"{src[key]:+.4f}",
                    f"{part[key]:.0%} of the total",
                    delta_color="off",
                    delta_arrow="off",
                    help=helps[key],
                )
            cols[-1].metric(
                "Cache used (pooled)",
                f"{sum(src[k] for k, *_ in PARTS):.4f}",
                help="Pooled over steps, layers and heads: sum ‖O − O_full‖ / sum ‖O_full‖ (the means "
                "above weigh every cell alike).",
            )
            chart(
                sources_figure(run),
                "pert_sources",
                name="perturbation-sources",
                config={"run": str(run.path)},
            )
            st.caption(
                "In the charts below, *same evictions, no merging* keeps the positions in full precision."
            )
        for kind in ("perturbation", "perturbation-layers"):
            chart(run_figure(run, kind), f"pert_{kind}", name=kind, config={"run": str(run.path)})
st.subheader("Against the budget (from a sweep)")
sweep_section(
    "pert",
    [
        (
            "Output perturbation against the budget, merging vs evicting (CaM Fig. 1d)",
            ["perturbation_used", "perturbation_evict"],
        )
    ],
)
