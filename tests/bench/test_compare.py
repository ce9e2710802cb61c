"""`kvlens.experiments.compare` (one measured pass per policy, batched or one by one, results reused) and
`kvlens compare --json`."""

from __future__ import annotations

import json

import pytest

import kvlens.experiments.compare as cmp
from kvlens.engine.attention import CONTEXT_KWARG
from kvlens.engine.loop import RunOptions
from kvlens.errors import KvlensError
from kvlens.experiments.api import generate
from kvlens.experiments.compare import Entry, ResultCache, batched_floor, compare, first_difference, table
from kvlens.kvcache.quantize import Storage
from tests.conftest import TEXTS, kvlens, one_sentence

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
ENTRIES = [Entry("streaming_llm", {"sink": 2}, 16), Entry("tova", {}, 12), Entry("full", {}, None)]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # stopped early


def test_the_full_cache_comes_first_and_every_policy_is_scored_on_its_text(tiny):
    out = compare(tiny, PROMPT, ENTRIES, 8)
    assert [r.entry.policy for r in out] == ["full", "streaming_llm", "tova"]  # full once, as the reference
    reference = out[0].run.meta.tokens
    assert out[0].run.meta.mode == "generate" and out[0].picks == reference and out[0].first_diff is None
    for r in out[1:]:
        assert r.run.meta.mode == "teacher" and r.run.meta.tokens == reference  # perplexity on full's text
        assert len(r.picks) == len(r.text.spans) == 8
    rows = table(out)
    assert [r["policy"] for r in rows] == ["full", "streaming_llm @16 (sink=2)", "tova @12"]
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-5) and rows[0]["perturbation"] == pytest.approx(
        0, abs=1e-5
    )
    assert all(r["kl"] > 1e-5 and r["perturbation"] > 1e-3 for r in rows[1:])
    assert rows[1]["kv_slots_max"] == 16 and rows[2]["kv_slots_max"] == 12 < rows[0]["kv_slots_max"]


def test_the_divergence_read_from_the_scored_pass_is_that_of_the_policys_own_generation(tiny):
    out = compare(tiny, PROMPT, ENTRIES, 8)
    reference = out[0].run.meta.tokens
    for r in out[1:]:
        own = generate(
            tiny,
            PROMPT,
            r.entry.policy,
            r.entry.params,
            opts=RunOptions(budget=r.entry.budget, max_new_tokens=8, stop_at_eos=False),
        )
        assert r.first_diff == first_difference(reference, own.meta.tokens)
        assert r.picks[: r.first_diff + 1] == own.meta.tokens[: r.first_diff + 1]


def test_each_ones_own_text_is_what_generate_writes_and_its_divergence_is_from_the_full_caches(tiny):
    out = compare(tiny, PROMPT, ENTRIES, 8)
    for r, row in zip(out, table(out), strict=True):
        own = generate(
            tiny,
            PROMPT,
            r.entry.policy,
            r.entry.params,
            opts=RunOptions(budget=r.entry.budget, max_new_tokens=8),
        )
        assert r.own.meta.tokens == own.meta.tokens and row["generated"] == own.meta.text
        assert r.generate_s > 0
        full = out[0].own.meta.tokens
        assert row["generated_divergence"] == (
            None if r is out[0] else first_difference(full, own.meta.tokens)
        )
    assert any(
        row["generated_divergence"] is not None for row in table(out)[1:]
    )  # the tiny model does diverge
    assert all(r.own is None for r in compare(tiny, PROMPT, ENTRIES, 8, own_text=False))


def test_identical_inputs_reuse_results_and_run_only_what_changed(tiny, monkeypatch):
    passes = []
    engine_run, measure_many = cmp.run, cmp._measure_many

    def counted(model, policy, *args, **kwargs):
        passes.append(policy.name)
        return engine_run(model, policy, *args, **kwargs)

    def counted_many(model, ids, entries, *args):
        passes.extend(e.policy for e in entries)
        return measure_many(model, ids, entries, *args)

    monkeypatch.setattr(cmp, "_measure_many", counted_many)
    monkeypatch.setattr("kvlens.experiments.api.run", counted)
    cache = ResultCache()
    first = compare(tiny, PROMPT, ENTRIES, 6, cache=cache)
    once = ["full", "streaming_llm", "tova"]
    assert passes == once  # one measured pass each: its own text resumes from it
    events = []
    again = compare(tiny, PROMPT, ENTRIES, 6, on_step=lambda e, ev: events.append(e), cache=cache)
    assert passes == once and not events  # the engine did not run again
    assert [r.run for r in again] == [r.run for r in first] and [r.own for r in again] == [
        r.own for r in first
    ]
    compare(tiny, PROMPT, [ENTRIES[0], Entry("tova", {}, 10)], 6, cache=cache)
    assert passes[3:] == ["tova"]  # only the changed budget runs
    compare(tiny, PROMPT, [Entry("streaming_llm", {"sink": 2}, 16)], 7, cache=cache, own_text=False)
    assert passes[4:] == ["full", "streaming_llm"]  # another length is another reference; no own texts asked
    compare(tiny, PROMPT, [Entry("streaming_llm", {"sink": 2}, 16)], 7, cache=cache)
    assert passes[6:] == [
        "full",
        "streaming_llm",
    ]  # measured without own texts: generated afresh, from the prompt


def test_own_texts_resume_from_the_divergence_and_generate_only_what_follows(tiny):
    """Each own text is generated from the step where it leaves the measured text: the first divergence of a
    policy (its earlier tokens are full's), the end of the text, or its last step; the row says how many
    steps."""
    out = compare(tiny, PROMPT, ENTRIES, 8)
    rows = table(out)
    assert out[0].own_from == 7 and rows[0]["generated_steps"] == 1  # full: its own text is its measured one
    for r, row in zip(out[1:], rows[1:], strict=True):
        start = 7 if r.first_diff is None else r.first_diff
        assert r.own_from == start and row["generated_steps"] == len(r.own.meta.tokens) - start
        assert r.own.meta.tokens[:start] == out[0].run.meta.tokens[:start]
        assert r.own.decisions["step"].max() == len(r.own.meta.tokens) - 1  # its log goes on past the fork
    assert any(r.first_diff is not None and r.first_diff < 7 for r in out[1:])  # something was resumed


@pytest.mark.parametrize(
    "entry",
    [Entry("streaming_llm", {"sink": 2}, 16), Entry("cam", {}, 12), Entry("adakv", {"base": "knorm"}, 12)],
    ids=["evicting", "merging", "per-head budget"],
)
def test_a_resumed_own_text_is_generates_run_generating_only_the_tokens_after_the_divergence(tiny, entry):
    """Resumed from its fork, the own text has `kvlens generate`'s tokens, text and decisions (kept slots at
    each step included), and the row counts only the steps after the first divergence (the unbatched path,
    whose floats are those of a run alone; the batched one is compared with it below)."""
    n = 12
    full, r = compare(tiny, PROMPT, [entry], n, batched=False)
    row = table([full, r])[1]
    own = generate(
        tiny, PROMPT, entry.policy, entry.params, opts=RunOptions(budget=entry.budget, max_new_tokens=n)
    )
    assert r.first_diff is not None and len(own.meta.tokens) == n  # it diverges, and runs to the end
    assert row["generated"] == own.meta.text and r.own.meta.tokens == own.meta.tokens
    assert r.own.decisions.equals(own.decisions)
    assert r.own.tensors["steps/kv_slots"].equal(own.tensors["steps/kv_slots"])
    assert row["generated_steps"] == n - r.first_diff


BATCHED = [
    Entry("streaming_llm", {"sink": 2}, 16),
    Entry("h2o", {}, 12),
    Entry("cam", {}, 12),
    Entry("tova", {}, 12),
]
FLOAT_COLUMNS = ("weights", "prob")  # the decisions' floats (merge weights, merge probabilities)
# measured: the batched and the unbatched rows differ by at most ~1e-6 relative in perplexity and ~1e-7 in KL,
# perturbation and attention loss (the tiny model and SmolLM2, float32); the bounds leave a margin of 10-100
TOLERANCE = {
    "ppl": (1e-5, 0),
    "kl": (1e-4, 1e-6),
    "perturbation": (1e-4, 1e-6),
    "attention_loss": (1e-4, 1e-6),
}


def assert_batched_is_unbatched(batched: list, alone: list) -> None:
    """The same texts, choices, decisions (their floats within rounding) and kept slots, measured and own,
    and the same rows up to the float envelope `TOLERANCE`."""
    for a, b in zip(batched, alone, strict=True):
        assert a.run.meta.tokens == b.run.meta.tokens and a.picks == b.picks
        assert (a.first_diff, a.own_from, a.own.meta.tokens) == (
            b.first_diff,
            b.own_from,
            b.own.meta.tokens,
        )
        for x, y in ((a.run, b.run), (a.own, b.own)):
            exact = [c for c in x.decisions.columns if c not in FLOAT_COLUMNS]
            assert x.decisions[exact].equals(y.decisions[exact])
            for column in FLOAT_COLUMNS:
                for u, v in zip(x.decisions[column], y.decisions[column], strict=True):
                    assert u == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True)
            assert x.tensors["steps/kv_slots"].equal(y.tensors["steps/kv_slots"])
        row_a, row_b = a.row(), b.row()
        for key, (rel, abs_) in TOLERANCE.items():
            assert row_a[key] == pytest.approx(row_b[key], rel=rel, abs=abs_), key
        floats = set(TOLERANCE) | {"ms_per_token"}
        assert {k: v for k, v in row_a.items() if k not in floats} == {
            k: v for k, v in row_b.items() if k not in floats
        }


def test_batched_compare_is_the_unbatched_one_in_one_forward_per_step(tiny, monkeypatch):
    """One shared prefill, then one batched forward per step for the full cache's generation, every policy's
    teacher-forced pass and each own text from its fork on; the results are the unbatched path's (decisions
    exactly, numbers within the float envelope)."""
    n = 12
    alone = compare(tiny, PROMPT, BATCHED, n, batched=False)
    batches = []
    forward = tiny.model.forward

    def counted(*args, **kwargs):
        batches.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", counted)
    batched = compare(tiny, PROMPT, BATCHED, n)
    assert_batched_is_unbatched(batched, alone)
    assert all(len(r.run.decisions) and len(r.own.decisions) for r in batched[1:])  # each one decides
    resumed = [r.own_from for r in batched[1:] if r.own_from < n - 1]
    assert resumed  # some own texts leave the measured one early and run in the batch from there
    prompt = len(batched[0].run.meta.prompt_tokens)
    assert batches[0] == (1, prompt)  # one prefill for all five (every pass records attention: one kernel)
    own_rows = [sum(r.own_from <= step for r in batched) for step in range(n - 1)]
    assert batches[1:] == [(5 + own_rows[step], 1) for step in range(n - 1)]


def test_the_floor_is_one_prefill_then_one_forward_of_every_measured_row_per_step(tiny, monkeypatch):
    """`kvlens compare --floor`'s yardstick: transformers' own forward, one prefill, then each step one batch
    of as many rows as the comparison measures, each decoding the full cache's own greedy text."""
    n = 6
    batches = []
    forward = tiny.model.forward

    def counted(*args, **kwargs):
        batches.append(tuple(kwargs["input_ids"].shape))
        assert CONTEXT_KWARG not in kwargs  # no kvlens attention: the model's own SDPA
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", counted)
    seconds, tokens = batched_floor(tiny, PROMPT, 4, n)
    prompt = len(tiny.tokenizer(PROMPT).input_ids)
    assert seconds > 0 and batches == [(1, prompt)] + [(4, 1)] * (n - 1)
    monkeypatch.setattr(tiny.model, "forward", forward)
    full = generate(tiny, PROMPT, "full", opts=RunOptions(max_new_tokens=n, stop_at_eos=False))
    assert tokens == full.meta.tokens


MIXES = {
    "quantized": [
        Entry("full", {}, None, Storage(bits=4, group=16)),
        Entry("h2o", {}, 12, Storage(bits=2, group=16)),
    ],
    "budget-free": [Entry("kvmerger", {}, None), Entry("corm", {}, None)],
    "per-head budgets": [Entry("adakv", {"base": "snapkv", "base.window": 4}, 12)],
    "replay passes": [Entry("kvzip", {}, 12), Entry("snapkv", {"window": 4}, 12)],
    "merging": [Entry("d2o", {}, 12), Entry("weightedkv", {}, 12), Entry("scissorhands", {}, 12)],
    "learned scores": [Entry("kvzap", {}, 12), Entry("kvzap", {"mode": "threshold", "window": 4}, None)],
}


@pytest.mark.parametrize("entries", MIXES.values(), ids=MIXES.keys())
def test_batched_compare_is_the_unbatched_one_for_every_kind_of_policy(tiny, entries):
    """Quantized storage, budget-free policies, per-head budgets, replay passes (KVzip), merging policies and
    learned scores (KVzap, each row's hidden states its own) batch as exactly as evicting ones."""
    assert_batched_is_unbatched(
        compare(tiny, PROMPT, entries, 12), compare(tiny, PROMPT, entries, 12, batched=False)
    )


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one by one"])
def test_running_out_of_memory_is_one_sentence_on_either_path(tiny, monkeypatch, batched):
    forward, calls = tiny.model.forward, []

    def short_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # past the prefill, inside the decode steps
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2 GB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", short_of_memory)
    with pytest.raises(KvlensError, match=r"^Out of memory on \d+ \+ 8 tokens .* the memory was freed"):
        compare(tiny, PROMPT, BATCHED, 8, batched=batched)


@pytest.mark.slow
def test_batched_compare_of_smollm2_is_the_unbatched_one(smol):
    """The issue's comparison (streaming_llm, h2o and cam at half the prompt) on SmolLM2: decisions, texts and
    kept slots exactly the unbatched path's, numbers within the float envelope."""
    prompt = (TEXTS / "1986-Reagan.txt").read_text()[2000:2420]
    entries = [Entry(p, {}, 0.5) for p in ("streaming_llm", "h2o", "cam")]
    assert_batched_is_unbatched(
        compare(smol, prompt, entries, 24), compare(smol, prompt, entries, 24, batched=False)
    )


@pytest.mark.slow
def test_compare_json_rows_agree_with_generate_and_ppl(smol, tmp_path):
    """One row per policy after the full reference; each number is what `kvlens ppl --measure` gives on the
    full cache's text, and the divergence is where `kvlens generate` leaves it."""
    prompt = "The President spoke to the Congress about the state of the economy, and"
    n = 8
    done = kvlens(
        "compare",
        "--policies",
        "full;streaming_llm:sink=2",
        "--budget",
        "16",
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(n),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["wall_s"] > 0 and out["generate_s"] > 0 and out["generation_s"] > 0
    full, stream = out["rows"]
    assert [full["name"], stream["name"]] == ["full", "streaming_llm"]
    assert full["first_divergence"] is None and full["kl"] == pytest.approx(0, abs=1e-4)
    ids = smol.tokenizer(prompt).input_ids
    text = prompt + out["reference_text"]
    assert (
        len(smol.tokenizer(text).input_ids) == len(ids) + n
    )  # the text tokenizes back to prompt + continuation
    (tmp_path / "t.txt").write_text(text)
    for row in (full, stream):
        ppl = kvlens(
            "ppl",
            "--policy",
            row["name"],
            *(["--budget", "16"] if row["budget"] else []),
            *(f"--set={k}={v}" for k, v in row["params"].items()),
            "--text-file",
            str(tmp_path / "t.txt"),
            "--prefill",
            str(len(ids)),
            "--tokens",
            str(n),
            "--measure",
            "--json",
        )
        assert ppl.returncode == 0, ppl.stderr
        want = json.loads(ppl.stdout)
        assert row["ppl"] == pytest.approx(want["ppl"], rel=1e-4)
        assert row["kl"] == pytest.approx(want["kl"], rel=1e-3, abs=1e-5)
        assert row["perturbation"] == pytest.approx(want["perturbation_used"], rel=1e-3, abs=1e-6)
        assert row["kv_bytes_peak"] == want["kv_bytes_peak"]
    own = kvlens(
        "generate",
        "--policy",
        "streaming_llm",
        "--budget",
        "16",
        "--set",
        "sink=2",
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(n),
        "--out",
        str(tmp_path / "run"),
    )
    assert own.returncode == 0, own.stderr
    own_run = json.loads((tmp_path / "run" / "run.json").read_text())
    tokens = own_run["tokens"]
    reference = smol.tokenizer(text).input_ids[len(ids) :]
    assert stream["first_divergence"] == first_difference(reference, tokens)
    assert stream["generated"] == own_run["text"]  # its own text is `kvlens generate`'s


@pytest.mark.parametrize(
    "args, words",
    [
        (["--policies", "h2o", "--budget", "0"], "positive number of slots"),
        (["--policies", "h2o,nope"], "nope"),
        (["--policies", "h2o,tova,cam,corm,scissorhands"], "1 to 4"),
        (["--policies", "h2o:recent_ratio=7"], "recent_ratio"),
    ],
)
def test_compare_refuses_bad_input_in_one_sentence(args, words):
    done = kvlens("compare", *args, "--prompt", "Hello")
    assert done.returncode == 2 and one_sentence(done.stderr) and words in done.stderr, done.stderr


@pytest.mark.slow
def test_compare_prints_a_row_per_policy_each_ones_own_text_and_the_times():
    done = kvlens("compare", "--policies", "streaming_llm,h2o", "--budget", "0.5", "--max-new-tokens", "4")
    assert done.returncode == 2  # no prompt: refused before the model loads
    prompt = "The President spoke to the Congress about the state of the economy, and"
    done = kvlens(
        "compare", "--policies", "streaming_llm", "--budget", "8", "--max-new-tokens", "4", "--prompt", prompt
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("full cache: ") and any(line.startswith("streaming_llm @8") for line in lines)
    assert "Each one's own text:" in lines and lines[-1].startswith("compared in ")
    assert "one plain generation of the full cache" in lines[-1]
