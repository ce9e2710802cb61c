"""Why: which of a policy's removals made the compressed cache get it wrong (cache patching, `kvlens
explain`). Each group of removals is restored alone from the full cache; its recovered share is the part of
the answer's log-probability gap it closes. The greedy smallest sufficient set is drawn on the Head grid's
strips."""

import time

import streamlit as st

from kvlens.experiments.bench.ruler import TASKS
from kvlens.explain.groups import GROUPINGS
from kvlens.explain.search import BATCH
from kvlens.figures.why import figures
from kvlens.policies import make_policy, policy_names
from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import page_top, selected_run
from kvlens.ui.views import escaped
from kvlens.ui.why import explain_run, explain_sample, patch_count, suite

RUN, SAMPLE = "the selected run", "a task sample"
SOURCES = [RUN, SAMPLE]
RATIOS = [0.25, 0.5, 0.75, 0.875]
LENGTHS = [256, 512, 1024, 2048]
BUDGETED = [p for p in policy_names() if p != "full" and not make_policy(p).budget_free]

page_top(
    "Why",
    "Restore each group of the policy's removals from the full cache and score the full cache's own "
    "answer: the recovered share is the part of the log-probability gap that group closes.",
)
source = url_state.bound(
    lambda **kw: st.radio("Explain", SOURCES, horizontal=True, **kw),
    "source",
    "why_source",
    SOURCES,
    "source",
    SOURCES[0],
    show=lambda s: s.split()[-1],
)
c1, c2, c3 = st.columns([3, 1, 1])
by = url_state.bound_many(
    lambda **kw: c1.multiselect("Groups", GROUPINGS, **kw),
    "by",
    "why_by",
    list(GROUPINGS),
    "groups",
    ["layer", "head", "span", "sinks", "needle"],
)
span = url_state.bound(
    lambda **kw: c2.selectbox("Span (tokens)", [8, 16, 32, 64, 128], **kw),
    "span",
    "why_span",
    [8, 16, 32, 64, 128],
    "span",
    32,
)
minimal = url_state.bound(
    lambda **kw: c3.checkbox("Smallest sufficient set", **kw),
    "minimal",
    "why_minimal",
    [True, False],
    "minimal set",
    True,
    show=lambda v: str(v).lower(),
)
if not by:
    st.info("Pick at least one grouping.")
    st.stop()
if source == SAMPLE:
    conventions = suite()
    samples = list(range(int(dict(conventions)["count"])))
    cols = st.columns(5)
    task = url_state.bound(
        lambda **kw: cols[0].selectbox("Task", list(TASKS), **kw),
        "task",
        "why_task",
        list(TASKS),
        "task",
        "niah_single",
    )
    length = url_state.bound(
        lambda **kw: cols[1].selectbox("Length", LENGTHS, **kw),
        "length",
        "why_length",
        LENGTHS,
        "length",
        1024,
    )
    index = url_state.bound(
        lambda **kw: cols[2].selectbox("Sample", samples, **kw),
        "index",
        "why_index",
        samples,
        "sample index",
        0,
    )
    policy = url_state.bound(
        lambda **kw: cols[3].selectbox("Policy", BUDGETED, **kw),
        "policy",
        "why_policy",
        BUDGETED,
        "policy",
        "snapkv",
    )
    ratio = url_state.bound(
        lambda **kw: cols[4].selectbox("Ratio (share removed)", RATIOS, **kw),
        "ratio",
        "why_ratio",
        RATIOS,
        "ratio",
        0.75,
    )
    work = lambda: explain_sample(task, length, index, policy, ratio, tuple(by), span, minimal, conventions)  # noqa: E731
    name = f"why-{task}-{length}-{index}-{policy}-{ratio}"
    config = {"task": task, "length": length, "index": index, "policy": policy, "ratio": ratio}
    if not st.session_state.get(f"why_asked_{name}") and not st.button(
        "Explain this sample", help="Minutes for a 1024-token sample on a CPU; then kept for this setting"
    ):
        url_state.share_link()
        st.stop()
    st.session_state[f"why_asked_{name}"] = True
else:
    run = selected_run()
    if run is None:
        st.stop()
    work = lambda: explain_run(str(run.path), tuple(by), span, minimal)  # noqa: E731
    name, config = f"why-{run.path.name}", {"run": str(run.path)}
    asked = f"why_asked_{name}-{'-'.join(by)}-{span}-{minimal}"
    patches = patch_count(run, by, span, minimal)
    if not st.session_state.get(asked) and not st.button(
        "Explain this run",
        help="Then kept for these settings",
    ):
        st.caption(
            f"About {patches:,} patched caches for these groups, scored {BATCH} at a time: about "
            f"{-(-patches // BATCH):,} forwards of the answer (seconds to a minute on a CPU)."
        )
        url_state.share_link()
        st.stop()
    st.session_state[asked] = True
url_state.share_link()
t = time.perf_counter()
with st.spinner("Patching the cache (seconds for a short run, minutes for a 1024-token sample on a CPU)…"):
    result = work()
config.update(by=by, span=span, minimal=minimal)

answers = result["answers"]
c1, c2, c3, c4 = st.columns(4)
c1.metric(
    "Log-probability gap",
    f"{result['lp_full'] - result['lp_compressed']:.2f} nats",
    help="The full cache's answer scored on the full cache minus on the compressed one",
)
c2.metric("All groups restored", f"{result['all_groups']['recovered_share']:.3f}", help="Should be 1")
c3.metric("No group restored", f"{result['no_groups']['recovered_share']:.3f}", help="Should be 0")
c4.metric("Entries removed", f"{result['slots_removed']:,}")
if "compressed" in answers:
    st.markdown(
        f"<div style='white-space:pre-wrap'><b>Full cache:</b> {escaped(answers['full'][:160])}<br>"
        f"<b>Compressed:</b> {escaped(answers['compressed'][:160])}</div>",
        unsafe_allow_html=True,
    )
m = result.get("minimal")
if m and m["found"]:
    verdict = f"; its answer is {'right' if m['right'] else 'wrong'}" if "right" in m else ""
    st.success(
        f"Smallest sufficient set: {len(m['groups'])} {m['by']} groups ({', '.join(m['groups'][:12])}"
        f"{', …' if len(m['groups']) > 12 else ''}), {m['slots']:,} of {m['slots_removed']:,} removed slots, "
        f"in layers {', '.join(map(str, m['layers']))}; recovers {m['recovered_share']:.2f} of the gap"
        f"{verdict} (search {m['seconds']:.1f} s)."
    )
elif m:
    st.warning("No prefix of the groups, in order of recovered share, fixes the answer.")
for view, fig in figures(result).items():
    if isinstance(fig, str):
        st.caption(fig)
    else:
        chart(fig, f"why_{view}", name=f"{name}-{view}", config=config)
cost = result["cost"]
st.caption(
    f"{cost['patched_caches']} patched caches in batches of {cost['batch']}: {cost['total_s']:.1f} s on "
    f"{cost['threads']} thread(s) (this view: {time.perf_counter() - t:.1f} s)."
)
