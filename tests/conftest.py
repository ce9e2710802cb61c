"""Shared fixtures and helpers: a tiny random GQA Llama (seconds, no download), the embedded SmolLM2, the
shipped runs, the `kvlens` command and the examples of docs/extending.md."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import settings

from kvlens import texts
from kvlens.engine.attention import ATTENTION_NAME, register_attention
from kvlens.engine.models import LoadedModel

# `make test` runs every property test derandomized: the same examples on every run, so a red CI
# always means a change. `make fuzz` sets KVLENS_FUZZ: random seeds and 20x the examples.
FUZZ = bool(os.environ.get("KVLENS_FUZZ"))
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, deadline=None, print_blob=True)
settings.load_profile("fuzz" if FUZZ else "ci")


def examples(n: int) -> int:
    """A property test's example count: n in CI, 20 n under `make fuzz`."""
    return n * 20 if FUZZ else n


def pytest_collection_modifyitems(config, items):
    """Mark every Hypothesis test `property`, so `make fuzz` can select them; deselect the `cuda` tests where
    torch sees no CUDA GPU (`make test-cuda` runs them on one)."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("cuda")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if item not in gpu]


def pytest_report_header(config):
    return "cuda tests: " + (
        "run (" + torch.cuda.get_device_name() + ")"
        if torch.cuda.is_available()
        else "deselected (torch sees no CUDA GPU; make test-cuda runs them on one)"
    )


ROOT = Path(__file__).resolve().parent.parent
TEXTS = texts.DIR
CACHED_RUNS = ROOT / "cached_runs"  # the runs shipped with the repository, which the app opens first
TEST_DATA = ROOT / "tests" / "data"  # stored references: golden runs, kvpress and quanto values
# `make test-cuda` runs the engine's tests with their models on a GPU: KVLENS_TEST_DEVICE=cuda (fp32, as on
# CPU).
DEVICE = torch.device(os.environ.get("KVLENS_TEST_DEVICE", "cpu"))


class ByteTokenizer:
    """A byte-level tokenizer for the tiny model: token id = byte value, 255 = eos."""

    eos_token_id = 255
    chat_template = None

    def __call__(self, text):
        return type("Enc", (), {"input_ids": list(text.encode("utf-8"))})()

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids):
        """GPT-2's byte-level symbols of the bytes (a str for one id, as Hugging Face's tokenizers do)."""
        from kvlens.runs.token_text import symbol_of_byte

        if isinstance(ids, int):
            return symbol_of_byte(ids % 256)
        return [symbol_of_byte(int(i) % 256) for i in ids]


def tiny_model(layers: int = 3, seed: int = 0) -> LoadedModel:
    """Llama with 4 query heads over 2 KV heads (GQA), head_dim 16, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        attn_implementation=ATTENTION_NAME,
    )
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    return LoadedModel(
        model=model,
        tokenizer=ByteTokenizer(),
        spec="tiny",
        path=Path("."),
        device=DEVICE,
        dtype=torch.float32,
    )


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


def write_scorer(model: LoadedModel, path: Path, seed: int = 0) -> Path:
    """A KVzap scorer file for `model` with random linear weights (`kvlens.engine.scorers`)."""
    from kvlens.engine import scorers

    gen = torch.Generator().manual_seed(seed)
    shape = model.shape()
    width = model.model.config.hidden_size
    layers = [
        scorers.LayerScorer(
            torch.randn(shape["kv_heads"], width, generator=gen),
            torch.randn(shape["kv_heads"], generator=gen),
        )
        for _ in range(shape["layers"])
    ]
    scorers.save(path, layers, model, {"fit": "[]", "command": "tests.conftest.write_scorer"})
    return path


@pytest.fixture(scope="session", autouse=True)
def _tiny_scorer(tmp_path_factory):
    """The tiny model's KVzap scorer (random weights) where `kvzap:scorer=auto` finds it ($KVLENS_SCORERS)."""
    folder = tmp_path_factory.mktemp("scorers")
    write_scorer(tiny_model(), folder / "tiny.safetensors")
    before = os.environ.get("KVLENS_SCORERS")
    os.environ["KVLENS_SCORERS"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("KVLENS_SCORERS", None)
    else:
        os.environ["KVLENS_SCORERS"] = before


@pytest.fixture(scope="session")
def smol():
    from kvlens.engine.models import load_model

    return load_model("default", device=str(DEVICE), dtype="float32")


def model_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """`(T, vocab)` float logits of the model's own forward over `ids` (no kvlens run), on the model's
    device."""
    with torch.no_grad():
        return model.model(torch.tensor([ids], device=model.device)).logits[0].float()


@pytest.fixture(scope="session")
def long_text():
    return (TEXTS / "1961-Kennedy.txt").read_text()


def layer_rows(limit: int | None = None):
    """A standalone layer of a one-layer cache (the policy unit tests' cache); `limit` as in a run."""
    from kvlens.kvcache.cache import KVCache

    return KVCache(1, limit=limit).layers[0]


class Slots(NamedTuple):
    """Rows' kept slots in position order (oldest first; free and padding slots last, position -1)."""

    pos: torch.Tensor  # (R, S)
    keys: torch.Tensor  # (1, R, S, D)
    values: torch.Tensor  # (1, R, S, D)
    valid: torch.Tensor  # (R, S)


def in_position_order(rows) -> Slots:
    """The kept slots of `rows` (a `SlotRows`) in position order, `n_kept` per row (a copy): what an
    append-only cache would hold."""
    order = rows.position_order()[:, : rows.n_kept]
    idx = order[None, :, :, None].expand(1, -1, -1, rows.keys.shape[-1])
    return Slots(
        rows.pos.masked_fill(~rows.valid, -1).gather(1, order),
        rows.keys.gather(2, idx),
        rows.values.gather(2, idx),
        rows.valid.gather(1, order),
    )


def shrink(policy, rows, budget: int | None, log=None, prompt: bool = False) -> None:
    """One compression of `rows` to `budget`: the prompt's (step 0) when `prompt`, else a decode step's."""
    from kvlens.kvcache import Phase, Step

    policy.compress(rows, Step(0 if prompt else 1, Phase.PREFILL if prompt else Phase.DECODE, budget, log))


TINY_RUN_T = 160  # the prompt tokens of `tiny_run`


def within_budget(policy, run, budget: int) -> bool:
    """Whether a run of `policy` held its `budget` at every step (`steps/kv_slots` `(T, L, Hkv)`): a policy
    that compresses at decode steps holds it (its total over layers and heads, and each head when its
    selection is per head); one whose protocol compresses the prompt once (`Needs.decode_steps` false)
    holds it after the prompt and grows by one slot per head per step after."""
    kept = run.tensors["steps/kv_slots"].long()
    t, layers, heads = kept.shape
    grown = torch.zeros(t, dtype=torch.long) if policy.needs().decode_steps else torch.arange(t)
    total = bool((kept.sum((1, 2)) <= (budget + grown) * layers * heads).all())
    return total and (policy.competes != "head" or bool((kept.amax((1, 2)) <= budget + grown).all()))


@functools.cache
def tiny_run(tmp_dir: str | None = None):
    """A full-cache run of the tiny model with prefill states (TINY_RUN_T prompt tokens, 4 steps), saved if
    asked."""
    from kvlens.engine.loop import RunOptions
    from kvlens.engine.loop import run as engine_run
    from kvlens.policies import make_policy
    from kvlens.texts import prefix_ids

    model = tiny_model()
    text = (TEXTS / "1961-Kennedy.txt").read_text()
    ids = prefix_ids(model, text, TINY_RUN_T)
    opts = RunOptions(max_new_tokens=4, record="states")
    r = engine_run(model, make_policy("full"), ids, prefill=TINY_RUN_T, steps=4, teacher=False, opts=opts)
    if tmp_dir:
        r.save(tmp_dir)
    return r


@pytest.fixture(scope="module")
def cam():
    """The shipped CaM run with attention rows and perturbation (`cached_runs/cam-attention`)."""
    from kvlens import load_run

    return load_run(CACHED_RUNS / "cam-attention")


def kvlens(*args: str) -> subprocess.CompletedProcess:
    """`python -m kvlens ARGS` in a subprocess, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvlens", *args], capture_output=True, text=True, timeout=600
    )


def one_sentence(stderr: str) -> bool:
    """Whether the command's error output is one `kvlens: error: ` sentence and no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return len(lines) == 1 and lines[0].startswith("kvlens: error: ") and "Traceback" not in stderr


def doc_example(section: str) -> tuple[str, str]:
    """The first python block of a section of docs/extending.md and the file name the section says to save it
    as."""
    text = (ROOT / "docs" / "extending.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", body, re.S).group(1)
    path = re.search(r"saved as `([^`]+\.py)`", body).group(1)
    return path, code


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny model saved as a model directory that `load_model` (and so every worker) can read:
    its weights plus a byte-level tokenizer (token id = byte value, as in the tests' ByteTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().model.save_pretrained(path)
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[255]).save_pretrained(path)
    return path


@pytest.fixture
def no_network(monkeypatch):
    """No network for the test: every connection attempt raises, and is listed in the yielded list (code
    that swallows the error is still caught)."""
    import socket

    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(f"a network connection was attempted in an offline test: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def _published(name: str) -> dict:
    return json.loads((ROOT / "results" / f"{name}.json").read_text(encoding="utf-8"))


@functools.cache
def every_figure() -> dict:
    """{name: figure} of each run analysis on the first shipped run that has what it needs, and of each
    published benchmark's figures (`results/`): what the figure layout and export tests go through."""
    from kvlens import load_run
    from kvlens.analysis.registry import analyses, analysis_figure, get_analysis, lacks
    from kvlens.experiments.bench import frontier, needle, ppl, task_needles, tasks
    from kvlens.figures.speed import families, speed_figure

    runs = [load_run(p.parent) for p in sorted(CACHED_RUNS.glob("*/run.json"))]
    out = {}
    for kind in analyses():
        analysis = get_analysis(kind)
        if analysis.inputs != "run" or analysis.replays:
            continue
        usable = [r for r in runs if lacks(analysis, r) is None]
        if usable:
            try:
                out[f"{kind} ({usable[0].path.name})"] = analysis_figure(kind, usable[0])
            except Exception as err:  # a run too short for it (variance): one sentence, tested elsewhere
                if type(err).__name__ != "KvlensError":
                    raise
    for name in ("bench_tasks", "bench_tasks_query_aware"):
        result = _published(name)
        cells = task_needles.grid(result["rows"])
        out[name] = tasks.figure(result)
        out[f"{name} needles"] = task_needles.figure(
            cells, task_needles.default_ratio(cells), tasks.protocol(result.get("config", {}))
        )
    out["bench_frontier"] = frontier.figure(_published("bench_frontier"))
    out["bench_needle"] = needle.figure(_published("bench_needle"))
    out["bench_ppl"] = ppl.figure(_published("bench_ppl"))
    out["bench_speed"] = speed_figure(families(_published("bench_speed")))
    return out
