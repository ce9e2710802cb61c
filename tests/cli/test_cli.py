"""The `kvlens` command: exact names and JSON fields, bad input as one sentence with exit code 2."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlens.cli import main
from kvlens.errors import KvlensError
from kvlens.policies import REGISTRY, make_policy, parse_budget, parse_settings, resolve_budget
from tests.conftest import TEXTS, examples, kvlens, one_sentence

TEXT = str(TEXTS / "1961-Kennedy.txt")


def test_policies_json_lists_parameters_with_defaults():
    proc = kvlens("policies", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert set(REGISTRY) == set(rows)
    assert {"name": "sink", "default": 4}.items() <= rows["streaming_llm"]["parameters"][0].items()
    assert all(r["description"] for r in rows.values())


@pytest.mark.slow
def test_model_path_is_loadable_by_transformers():
    from transformers import AutoConfig

    proc = kvlens("model-path")
    assert proc.returncode == 0
    config = AutoConfig.from_pretrained(proc.stdout.strip())
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)


@pytest.mark.slow
def test_ppl_done_when_compressed_policies_stay_in_budget_and_lose_perplexity():
    def ppl(policy, *extra):
        proc = kvlens(
            "ppl",
            "--policy",
            policy,
            *extra,
            "--text-file",
            TEXT,
            "--prefill",
            "128",
            "--tokens",
            "64",
            "--json",
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    full = ppl("full")
    assert {
        "policy",
        "params",
        "budget",
        "prefill",
        "tokens",
        "nll",
        "ppl",
        "kv_slots_max",
        "kv_bytes_peak",
        "ms_per_token",
    } <= set(full)
    assert full["kv_slots_max"] == 128 + 63
    for policy in ("streaming_llm", "h2o", "tova", "scissorhands"):
        res = ppl(policy, "--budget", "32")
        assert res["kv_slots_max"] <= 32 and res["ppl"] > full["ppl"], (policy, res)


@pytest.mark.slow
def test_generate_then_show(tmp_path):
    out = tmp_path / "run"
    proc = kvlens(
        "generate",
        "--policy",
        "h2o",
        "--budget",
        "8",
        "--prompt",
        "The history of Rome",
        "--max-new-tokens",
        "12",
        "--record",
        "states",
        "--record-layers",
        "0,5",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(kvlens("show", "--run", str(out), "--json").stdout)
    assert shown["policy"]["name"] == "h2o" and shown["budget"]["slots"] == 8
    ratios = [f"{shown['metrics'][f'compression_ratio_{k}']:.3f}" for k in ("prompt", "final")]
    assert f"compression ratio {ratios[0]} after the prompt, {ratios[1]} at the end" in proc.stdout
    prompt_len = len(kvlens_run_tokens(out))
    assert shown["tensors"]["prefill/q/5"] == [9, prompt_len, 64] and "prefill/q/1" not in shown["tensors"]
    assert shown["command"].startswith("kvlens generate --policy h2o")


TIMINGS = {"ms_per_token", "prefill_ms", "total_s", "rss_peak", "rss_growth"}  # what the machine decides


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ppl", "generate"])
def test_the_same_command_twice_gives_bit_identical_runs(tmp_path, command):
    """Reproducible by construction: nll, decisions and metrics (all but timings) are bit-identical."""
    from kvlens import load_run

    source = (
        ["--text-file", TEXT, "--prefill", "64", "--tokens", "12"]
        if command == "ppl"
        else [
            "--prompt",
            "Fellow citizens, the state of the union",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.9",
        ]
    )
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        budget = "24" if command == "ppl" else "8"
        assert (
            main(
                [
                    command,
                    "--policy",
                    "cam",
                    "--budget",
                    budget,
                    "--set",
                    "base=h2o",
                    *source,
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        runs.append(load_run(out))
    a, b = runs
    for name in ("decisions.parquet", "tensors.safetensors"):  # the files themselves, byte for byte
        assert (tmp_path / "run0" / name).read_bytes() == (tmp_path / "run1" / name).read_bytes(), name
    assert a.tensors["steps/nll"].numpy().tobytes() == b.tensors["steps/nll"].numpy().tobytes()
    assert a.decisions.equals(b.decisions) and len(a.decisions)
    assert (a.decisions.action == "merge").any()
    assert {k: v for k, v in a.metrics.items() if k not in TIMINGS} == {
        k: v for k, v in b.metrics.items() if k not in TIMINGS
    }
    assert a.meta.tokens == b.meta.tokens


def kvlens_run_tokens(path):
    return json.loads((path / "run.json").read_text())["prompt_tokens"]


BAD = [
    (["ppl", "--policy", "nope", "--text-file", TEXT], "Unknown policy 'nope'"),
    (["ppl", "--policy", "h2o", "--set", "window=3", "--text-file", TEXT], "no parameter 'window'"),
    (["ppl", "--policy", "h2o", "--set", "recent_ratio=lots", "--text-file", TEXT], "must be a number"),
    (["ppl", "--policy", "h2o", "--set", "recent_ratio", "--text-file", TEXT], "KEY=VALUE"),
    (["ppl", "--policy", "h2o", "--budget", "-3", "--text-file", TEXT], "positive"),
    (["ppl", "--policy", "h2o", "--budget", "1.5", "--text-file", TEXT], "in (0, 1]"),
    (["ppl", "--policy", "h2o", "--budget", "many", "--text-file", TEXT], "number of slots"),
    (["ppl", "--policy", "h2o", "--text-file", "/no/such/file"], "does not exist"),
    (["generate", "--policy", "h2o", "--prompt", "   ", "--out", "/tmp/x"], "prompt is empty"),
    (
        ["generate", "--policy", "h2o", "--prompt", "a", "--prompt-file", TEXT, "--out", "/tmp/x"],
        "not allowed with",
    ),
    (
        [
            "generate",
            "--policy",
            "full",
            "--prompt",
            "hi",
            "--record",
            "summary",
            "--record-layers",
            "1",
            "--out",
            "/tmp/x",
        ],
        "--record-layers needs",
    ),
    (
        ["generate", "--policy", "full", "--prompt", "hi", "--temperature", "-1", "--out", "/tmp/x"],
        "temperature",
    ),
    (["ppl", "--policy", "full", "--text-file", TEXT, "--model", "/no/such/model.gguf"], "does not exist"),
    (
        ["ppl", "--policy", "full", "--text-file", TEXT, "--model", "no-such-org/no-such-model"],
        "Unknown model",
    ),
    (["ppl", "--policy", "full", "--text-file", TEXT, "--device", "cuda:7"], "no CUDA GPU"),
    (["show", "--run", "/no/such/run"], "not a run directory"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[:3]) + f"-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_sentence_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) if argv[0] == "frobnicate" or "--prompt-file" in argv else _nothing():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err
    assert one_sentence(err), err
    assert message in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_not_a_gguf_is_refused(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert main(["ppl", "--policy", "full", "--text-file", TEXT, "--model", str(fake)]) == 2
    err = capsys.readouterr().err
    assert one_sentence(err) and "not a GGUF file" in err


@pytest.mark.slow
def test_budget_problems_found_after_tokenizing_are_one_sentence(capsys):
    for budget, message in (("3", "below the 5 slots"), ("900", "never compress")):
        assert (
            main(
                [
                    "ppl",
                    "--policy",
                    "streaming_llm",
                    "--budget",
                    budget,
                    "--text-file",
                    TEXT,
                    "--prefill",
                    "256",
                    "--tokens",
                    "8",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert one_sentence(err) and message in err
    assert main(["ppl", "--policy", "full", "--text-file", TEXT, "--prefill", "9000", "--tokens", "8"]) == 2
    assert "fewer than prefill" in capsys.readouterr().err


settings_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


@settings(max_examples=examples(150), suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(sorted(REGISTRY)),
    key=st.one_of(
        settings_text,
        st.sampled_from(
            ["sink", "recent_ratio", "history", "threshold", "span", "mask", "clamp", "w", "r", "seed"]
        ),
    ),
    value=st.one_of(settings_text, st.integers(-5, 10**6).map(str), st.floats(allow_nan=True).map(str)),
    budget=st.one_of(settings_text, st.integers(-10, 10**6).map(str), st.floats().map(str)),
    prompt_len=st.integers(1, 5000),
    steps=st.integers(1, 500),
)
def test_fuzzed_settings_and_budgets_never_raise_anything_but_one_sentence(
    policy, key, value, budget, prompt_len, steps
):
    try:
        pol = make_policy(policy, parse_settings(policy, [f"{key}={value}"]))
        resolve_budget(pol, parse_budget(budget), prompt_len, prompt_len + steps)
    except KvlensError as err:
        assert str(err) and "\n" not in str(err)


@settings(max_examples=examples(25))
@given(key=settings_text, value=settings_text, budget=settings_text)
def test_fuzzed_command_lines_exit_2_with_one_sentence(key, value, budget):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        code = main(
            [
                "ppl",
                "--policy",
                "h2o",
                f"--set={key}={value}",
                f"--budget={budget}",
                "--text-file",
                TEXT,
                "--model",
                "/nonexistent/model.gguf",
            ]
        )
        assert code == 2
    assert one_sentence(err.getvalue()), err.getvalue()
