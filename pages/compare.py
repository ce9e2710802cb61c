"""Compare: 2-4 policies on one prompt, against the full cache: texts, divergence, metrics, aligned charts."""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.compare import Entry, compare, compare_figure, table
from kvlens.ui.jobs import PageJob
from kvlens.ui.page import page_top
from kvlens.ui.views import diverging_text
from kvlens.ui.widgets import policy_picker

DEFAULTS = ["streaming_llm", "h2o", "tova", "cam"]

page_top("Compare", "Several policies on one prompt, each against the full cache: where the text first differs, "
                    "perplexity on the full cache's continuation, KL and output perturbation, memory and speed.")

job = PageJob("cmp", "Stopped. Nothing was compared.")
job.begin()
prompt = st.text_area("Prompt", key="cmp_prompt", height=100,
                      value="The Constitution imposes upon me the obligation to give to the Congress information of "
                            "the State of the Union. While this has traditionally been interpreted as an annual "
                            "affair, this tradition has been broken in extraordinary times.")
c1, c2 = st.columns([1, 3])
count = c1.number_input("Policies", 2, 4, 2, key="cmp_count")
new_tokens = c2.slider("New tokens", 4, 128, 24, step=4, key="cmp_tokens")
cols = st.columns(int(count))
picks = []
for i, col in enumerate(cols):
    with col, st.container(border=True):
        picks.append(policy_picker(f"cmp{i}", default=DEFAULTS[i], label=f"Policy {i + 1}"))
b1, b2, _ = st.columns([1, 1, 3])
go_clicked = b1.button("Compare", type="primary", icon=":material/play_arrow:", key="cmp_go", width="stretch",
                       disabled=any(p is None for p in picks))
job.stop_button(b2)

if go_clicked and all(p is not None for p in picks):
    entries = [Entry(*p) for p in picks]
    status = st.empty()
    progress = {"n": 0}
    total = (len({e.policy for e in entries} - {"full"}) + 1) * new_tokens

    def draw(events):
        progress["n"] += len(events)
        status.progress(min(1.0, progress["n"] / total), text=f"Generating with {events[-1][0]}…")

    def work(model):
        return lambda on_step, cancel: compare(model, prompt, entries, new_tokens,
                                               lambda label, e: on_step((label, e)), cancel)

    result = job.run(work, draw, status)
    if result is not None:
        st.session_state.cmp_result = result
        status.empty()

outcomes = st.session_state.get("cmp_result")
if not outcomes:
    st.info("Pick the policies and press **Compare**. The full cache is always run too, as the reference.")
else:
    st.subheader("Generated texts")
    text_cols = st.columns(len(outcomes))
    for col, o in zip(text_cols, outcomes):
        with col, st.container(border=True):
            st.markdown(f"**{o.entry.label}**")
            diverging_text(o.pieces, o.first_diff, reference=o.entry.policy == "full")
    st.subheader("Metrics")
    st.dataframe(table(outcomes), hide_index=True, width="stretch",
                 column_config={"ppl on full's text": st.column_config.NumberColumn(format="%.2f"),
                                "KL to full (mean)": st.column_config.NumberColumn(format="%.4f"),
                                "perturbation (mean)": st.column_config.NumberColumn(format="%.3f"),
                                "attention loss": st.column_config.NumberColumn(format="%.3f"),
                                "peak KV (MiB)": st.column_config.NumberColumn(format="%.2f"),
                                "ms / token": st.column_config.NumberColumn(format="%.0f")})
    chart(compare_figure(outcomes), "cmp_fig", name="compare",
          config={"prompt": outcomes[0].generated.meta["prompt"], "new_tokens": len(outcomes[0].scored.meta["tokens"]),
                  "policies": [{"policy": o.entry.policy, "params": o.entry.params, "budget": o.entry.budget}
                               for o in outcomes]})
