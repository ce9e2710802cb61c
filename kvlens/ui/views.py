"""Small shared blocks of page layout: run header, metric row, texts with a highlighted divergence."""

from __future__ import annotations

import html

import streamlit as st

from kvlens.figures.plots import storage_label
from kvlens.figures.wording import layers_note, of_prompt, when
from kvlens.policies import changed_params
from kvlens.runs.decisions import counts
from kvlens.runs.run import Run, run_name
from kvlens.runs.token_text import TokenText


def _budget(run: Run) -> str:
    """The run's budget in words; a budget-free run's, the compression ratio its own rule reached."""
    b = run.meta.budget
    if b.slots is None:
        reached = run.meta.metrics.get("compression_ratio_final")
        return "no budget" if reached is None else f"no budget: compression ratio {reached:.3f} reached"
    return f"budget {b.slots} slots" + of_prompt(b.requested)


def _storage(run: Run) -> str:
    """ " · KV 4-bit kivi, group 64" for quantized storage; nothing for the model's dtype (and older runs)."""
    storage = run.meta.storage
    return when(storage and storage.get("bits") is not None, f" · KV {storage_label(storage)}")


def run_header(run: Run) -> None:
    """One line naming the run: policy, parameters, budget, KV storage (when quantized), mode, model,
    level."""
    pol = run.meta.policy
    params = ", ".join(f"{k}={v}" for k, v in changed_params(pol.name, pol.params).items())
    rec = run.meta.record
    st.markdown(
        f"**{pol.name}**" + when(params, f" ({params})") + f" · {_budget(run)}{_storage(run)} · "
        f"{run.meta.mode} · {len(run.meta.prompt_tokens)} prompt + "
        f"{len(run.meta.tokens)} new tokens · recorded `{rec.level}`"
        + layers_note(rec.layers)
        + f" · `{run_name(run, 'unsaved')}`"
    )


def metric_row(run: Run) -> None:
    m = run.metrics
    cols = st.columns(5)
    cols[0].metric(
        "Perplexity", f"{m['ppl']:.2f}", help="exp(mean NLL) of the produced tokens under this run"
    )
    cols[1].metric(
        "Peak KV cache",
        f"{m['kv_bytes_peak'] / 2**20:.2f} MiB",
        help=f"Allocated bytes after compression, stored as {storage_label(run.meta.storage)}; "
        f"the uncompressed prompt took {m.get('kv_bytes_prefill', 0) / 2**20:.2f} MiB",
    )
    cols[2].metric("Max slots / head", m["kv_slots_max"])
    ms = m.get("ms_per_token")
    cols[3].metric(
        "ms / token",
        f"{ms:.0f}" if ms else "n/a",
        help="Wall time per decode step, recording and measuring included (this machine, at that time)",
    )
    kl = m.get("kl")
    cols[4].metric(
        "KL to full",
        f"{max(kl, 0.0):.4f}" if kl is not None else "not measured",  # KL >= 0: no "-0.0000"
        help="Mean KL(p_full || p_policy) per step; measured runs only (--measure)",
    )


def decision_counts(run: Run) -> str:
    """The sentence every page uses for a run's evictions and merges (`kvlens.runs.decisions.counts`)."""
    c = counts(run.decisions)
    zero = when(
        c.drew_zero, f" ({c.drew_zero:,} of them merges whose Bernoulli draw was 0, which moved nothing)"
    )
    return (
        f"In all layers, KV heads and steps: {c.evicted:,} positions evicted{zero} and {c.merged:,} merged "
        "into kept slots."
    )


def escaped(text: str) -> str:
    """`text` for HTML inside `st.markdown`: escaped, its newlines as `&#10;` (a blank line would end the HTML
    block for the markdown parser)."""
    return html.escape(text).replace("\n", "&#10;")


def token_text(run: Run) -> None:
    """Prompt in grey, generated (or scored) text in black."""
    prompt = escaped(run.meta.prompt)
    text = escaped(run.meta.text)
    st.markdown(
        f"<div style='white-space:pre-wrap;line-height:1.5'><span style='color:#888'>{prompt}</span>"
        f"<span class='kvlens-generated' style='background:#e8f0fe'>{text}</span></div>",
        unsafe_allow_html=True,
    )


def diverging_text(text: TokenText, first_diff: int | None, reference: bool = False) -> None:
    """Generated text with everything from the first token that differs from the full cache highlighted
    (from the start of its character, when that token holds part of one)."""
    if first_diff is None:
        body = escaped(text.text)
        st.markdown(
            f"<div class='kvlens-text' style='white-space:pre-wrap'>{body}</div>", unsafe_allow_html=True
        )
        st.caption("The reference." if reference else "Same as the full cache.")
        return
    same = escaped(text.before(first_diff))
    diff = escaped(text.after(first_diff))
    st.markdown(
        f"<div class='kvlens-text' style='white-space:pre-wrap'>{same}<span style='background:#ffd8a8' "
        f"title='differs from the full cache from here'>{diff}</span></div>",
        unsafe_allow_html=True,
    )
    st.caption(f"Diverges from the full cache at new token {first_diff}.")
