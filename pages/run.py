"""Run: a policy on your prompt or a bundled text, live plots while it runs, Stop cancels cleanly."""

import time

import streamlit as st

from kvlens import texts as bundled
from kvlens.levels import LEVELS, RecordLevel
from kvlens.ui import session, url_state
from kvlens.ui.inspector import token_inspector
from kvlens.ui.jobs import PageJob
from kvlens.ui.live import Live, RunSettings, parse_layers
from kvlens.ui.page import page_top, report_button
from kvlens.ui.state import list_runs, open_run, user_runs_dir
from kvlens.ui.views import token_text
from kvlens.ui.widgets import policy_picker, storage_picker

page_top("Run", "Run a policy on a prompt, watch it work, and save the run for the other pages.")
url_state.share_link()  # the policy, preset and budget below are in the link

job = PageJob("run", "Stopped. The run was cancelled and nothing was saved.")
stopped = job.begin()
saved = st.session_state.pop("run_saved", None)
if saved:
    st.success(f"Saved {saved}; it is now selected in the sidebar, so every page shows it.")

left, right = st.columns([2, 3], gap="large")
with left:
    mode = st.radio(
        "Mode",
        ["Generate", "Teacher-force (perplexity)"],
        horizontal=True,
        key="run_mode",
        help="Generate: greedy continuation of the prompt. Teacher-force: score the text's own next "
        "tokens after a prefill (perplexity).",
    )
    teacher = mode.startswith("Teacher")
    source = st.radio(
        "Text",
        ["Type a prompt", "Bundled text"],
        horizontal=True,
        key="run_source",
        index=1 if teacher else 0,
    )
    if source == "Bundled text":
        name = st.selectbox("Bundled text (State of the Union addresses)", bundled.ids(), key="run_text")
        text = bundled.read(name)
    else:
        text = st.text_area(
            "Prompt",
            key="run_prompt",
            height=140,
            value="The history of the United States Congress begins in 1789, when",
        )
    url_state.bind_policy("run")
    picked = policy_picker("run")
    url_state.publish_policy("run")
    storage = storage_picker("run")
    chunk = st.number_input(
        "Prefill chunk (0: the whole prompt at once)",
        0,
        65536,
        0,
        step=128,
        key="run_chunk",
        help="Feed the prompt this many tokens at a time and compress after each chunk, so that "
        "no layer holds more than budget + chunk slots (`--prefill-chunk`; full, "
        "streaming_llm, h2o, tova). Such runs record the summary only, unmeasured.",
    )
    c1, c2 = st.columns(2)
    if teacher:
        prefill = c1.number_input("Prefill tokens", 8, 4096, 256, step=32, key="run_prefill")
        new_tokens = c2.number_input("Scored tokens", 1, 2048, 64, step=16, key="run_tokens")
    else:
        prefill = 0
        new_tokens = c1.number_input("New tokens", 1, 1024, 48, step=8, key="run_new")
        if source == "Bundled text":
            chars = c2.number_input(
                "Prompt characters",
                50,
                20000,
                1000,
                step=250,
                key="run_chars",
                help="Use the start of the bundled text as the prompt.",
            )
            text = text[:chars]
    c3, c4 = st.columns(2)
    record = c3.selectbox(
        "Record",
        LEVELS[::-1],
        key="run_record",
        disabled=bool(chunk),
        help=f"{RecordLevel.SUMMARY}: tokens, metrics, decisions. {RecordLevel.STATES}: + prompt "
        f"q/k/v (Similarity, Spectra). {RecordLevel.ATTENTION}: + attention rows of every "
        "step (Attention).",
    )
    layers_text = c4.text_input(
        "Layers to record",
        "0,15,29",
        key="run_layers",
        disabled=record == RecordLevel.SUMMARY,
        help="'all' or comma-separated layers; fewer layers keep the run small.",
    )
    measure = st.checkbox(
        "Measure perturbation and KL to the full cache",
        value=True,
        key="run_measure",
        disabled=bool(chunk),
        help="Keeps an uncompressed shadow cache (slower); fills the Perturbation page.",
    )
    if chunk:  # a chunked prefill records the summary only, unmeasured (`kvlens.engine.loop`)
        record, measure = RecordLevel.SUMMARY, False
    b1, b2 = st.columns(2)
    go_clicked = b1.button(
        "Run",
        type="primary",
        icon=":material/play_arrow:",
        width="stretch",
        key="run_go",
        disabled=picked is None or storage is None,
    )
    job.stop_button(b2, help="Cancel the running run; nothing is saved.")

with right:
    status = st.empty()
    live_chart = st.empty()
    live_text = st.empty()
    if not go_clicked:
        if not st.session_state.get("run_last"):
            if not stopped:
                status.info("Set up a run on the left and press **Run**. Plots appear here while it runs.")
        else:  # the run this page saved last: its report, its text, and its tokens inspected
            last = open_run(st.session_state.run_last)
            head, report = st.columns([4, 1], vertical_alignment="bottom")
            head.subheader("Your last run")
            report_button([last], "run_report", report)
            token_text(last)
            st.markdown("**Token inspector**")
            token_inspector(last, "run_insp")

if go_clicked and picked is not None and storage is not None:
    policy, params, budget = picked
    live = Live(quantized=storage.packed)
    frame = [0]

    def work(model):
        live.names = model.tokenizer.convert_ids_to_tokens
        layers = None if record == RecordLevel.SUMMARY else parse_layers(layers_text, model.shape()["layers"])
        return RunSettings(
            policy,
            params,
            budget,
            text,
            teacher,
            int(new_tokens),
            int(prefill),
            record,
            layers,
            measure,
            storage=storage,
            prefill_chunk=int(chunk) or None,
        ).work(model)

    def draw(events):
        live.add(events)
        frame[0] += 1
        status.info(
            f"Running {policy}: step {live.steps[-1] + 1} of {new_tokens}, {live.seconds():.1f} s. "
            "Press **Stop** to cancel."
        )
        live_chart.plotly_chart(live.figure(), key=f"run_live_{frame[0]}")
        with live_text.container():
            st.markdown("**Output so far:**")
            st.text(live.text)

    with st.spinner("Running…"):
        run = job.run(work, draw, status)
    if run is not None:
        kv = f"-kv{storage.bits}" if storage.quantized else ""
        path = run.save(user_runs_dir() / f"{policy}{kv}-{time.strftime('%Y%m%d-%H%M%S')}")
        list_runs.clear()
        st.session_state[session.RUN_REQUEST] = str(path)
        st.session_state.run_saved = path.name
        st.session_state.run_last = str(path)
        st.rerun()
    live_chart.empty()  # the failed run's plots: `status` says why it stopped
    live_text.empty()
