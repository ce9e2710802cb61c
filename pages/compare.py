"""Compare: 2-4 policies on one prompt, against the full cache: texts, divergence, metrics, aligned charts."""

import streamlit as st

from kvlens.experiments.compare import Entry, compare, entries_with_reference
from kvlens.runs.token_text import decode
from kvlens.ui.compare import result_cache, show_results, show_text
from kvlens.ui.jobs import PageJob
from kvlens.ui.live import check_storage
from kvlens.ui.page import page_top
from kvlens.ui.widgets import policy_picker, storage_picker

DEFAULTS = ["streaming_llm", "h2o", "tova", "cam"]

page_top(
    "Compare",
    "Several policies on one prompt, each against the full cache: where its text first differs, "
    "perplexity on the full cache's continuation, KL and output perturbation, memory and speed. "
    "One measured pass per policy, teacher-forced on the full cache's text, all of them together (one "
    "prefill, then one batched forward per token); earlier results are reused.",
)

job = PageJob("cmp", "Stopped. Nothing was compared.")
stopped = job.begin()
prompt = st.text_area(
    "Prompt",
    key="cmp_prompt",
    height=100,
    value="The Constitution imposes upon me the obligation to give to the Congress information of "
    "the State of the Union. While this has traditionally been interpreted as an annual "
    "affair, this tradition has been broken in extraordinary times.",
)
c1, c2 = st.columns([1, 3])
count = c1.number_input("Policies", 2, 4, 2, key="cmp_count")
new_tokens = c2.slider("New tokens", 4, 128, 24, step=4, key="cmp_tokens")
cols = st.columns(int(count))
picks = []
for i, col in enumerate(cols):
    with col, st.container(border=True):
        policy = policy_picker(f"cmp{i}", default=DEFAULTS[i], label=f"Policy {i + 1}")
        storage = storage_picker(f"cmp{i}")
        picks.append(None if policy is None or storage is None else (*policy, storage))
b1, b2, _ = st.columns([1, 1, 3])
go_clicked = b1.button(
    "Compare",
    type="primary",
    icon=":material/play_arrow:",
    key="cmp_go",
    width="stretch",
    disabled=any(p is None for p in picks),
    help="Fix the settings marked above first." if any(p is None for p in picks) else None,
)
job.stop_button(b2)

failed = False
if go_clicked and all(p is not None for p in picks):
    entries = [Entry(*p) for p in picks]
    runs = entries_with_reference(entries)  # settings were checked by the pickers
    status = st.empty()
    cards = st.empty()  # each pass's progress and text so far, cleared if the comparison fails
    live = {}
    with cards.container():
        for e, col in zip(runs, st.columns(len(runs))):
            with col, st.container(border=True):
                live[e.label] = {
                    "bar": st.progress(0.0, text=f"{e.label}: waiting (or reused)"),
                    "text": st.empty(),
                    "pieces": [],
                    "full": [],
                    "diff": None,
                }

    def draw(events):
        for label, piece, fed, event in events:
            state = live[label]
            if (
                state["diff"] is None and int(event.logits.argmax()) != event.token
            ):  # teacher-forced on full's text
                state["diff"] = event.step
            state["pieces"].append(piece)
            state["full"].append(fed)
            state["bar"].progress(
                (event.step + 1) / new_tokens, text=f"{label}: token {event.step + 1} of {new_tokens}"
            )
        for label in {label for label, *_ in events}:
            state = live[label]
            with state["text"].container():
                show_text(
                    label,
                    decode(state["pieces"]),
                    state["diff"],
                    None if label == runs[0].label else decode(state["full"]),
                )

    def work(model):
        def on_step(put):
            names = model.tokenizer.convert_ids_to_tokens
            return lambda entry, event: put(
                (entry.label, names(int(event.logits.argmax())), names(event.token), event)
            )

        for e in entries:
            check_storage(e.storage, model)
        cache = result_cache()
        return lambda put, cancel: compare(model, prompt, entries, new_tokens, on_step(put), cancel, cache)

    result = job.run(work, draw, status)
    if result is not None:
        st.session_state.cmp_result = result
        st.rerun()
    cards.empty()
    failed = True  # `status` says why

results = st.session_state.get("cmp_result")
if results:
    if failed:
        st.caption("Below: the last comparison that finished, not the one asked for above.")
    show_results(results)
elif not (failed or stopped):
    st.info(
        "Pick the policies and press **Compare**. The full cache is always run too, as the reference (in the "
        "model's dtype; pick `full` with quantized storage to see what quantization alone does)."
    )
