"""Shared fixtures: a tiny random GQA Llama (seconds, no download) and the embedded SmolLM2."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

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
    """Mark every Hypothesis test `property`, so `make fuzz` can select them; deselect the `cuda` tests where torch
    sees no CUDA GPU (`make test-cuda` runs them on one)."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("cuda")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if item not in gpu]


def pytest_report_header(config):
    return "cuda tests: " + ("run (" + torch.cuda.get_device_name() + ")" if torch.cuda.is_available()
                             else "deselected (torch sees no CUDA GPU; make test-cuda runs them on one)")

ROOT = Path(__file__).resolve().parent.parent
TEXTS = texts.DIR
# `make test-cuda` runs the engine's tests with their models on a GPU: KVLENS_TEST_DEVICE=cuda (fp32, as on CPU).
DEVICE = torch.device(os.environ.get("KVLENS_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def external_requests() -> list[str]:
    """The URLs outside 127.0.0.1 that a browser test module's pages asked for (refused by
    `kvlens.ui.browser.refuse_external`, which the module's browser fixture installs with this list)."""
    return []


@pytest.fixture
def offline(external_requests):
    """Fail the browser test during which (or before which, in the module's setup) a page requested
    anything from a host other than 127.0.0.1: the app must work without internet."""
    yield
    seen = sorted(set(external_requests))
    external_requests.clear()
    assert not seen, f"the app requested {len(seen)} URL(s) outside 127.0.0.1 (it must work offline): {seen}"


@contextmanager
def chromium_app(runs_dir: Path):
    """`streamlit run app.py` on the runs folder `runs_dir` and a headless Chromium: yields (chromium, url). Skips
    the module when Debian's chromium is missing."""
    from kvlens.ui.browser import CHROMIUM, CHROMIUM_ARGS, streamlit_server

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package (make test does so when run as root)")
    from playwright.sync_api import sync_playwright

    with streamlit_server(env={**os.environ, "KVLENS_RUNS": str(runs_dir)}) as url, sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium, url
        finally:
            chromium.close()


def offline_page(chromium, external_requests: list[str], width: int = 1500, height: int = 1000):
    """A page in a new browser context (no cookies, no session) whose requests off 127.0.0.1 are refused and
    recorded in `external_requests` (the `offline` fixture then fails the test)."""
    from kvlens.ui.browser import refuse_external

    context = chromium.new_context(viewport={"width": width, "height": height})
    refuse_external(context, external_requests)
    return context.new_page()


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
        return [chr(i) for i in ids]


def tiny_model(layers: int = 3, seed: int = 0) -> LoadedModel:
    """Llama with 4 query heads over 2 KV heads (GQA), head_dim 16, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rope_theta=10000.0, attn_implementation=ATTENTION_NAME)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), spec="tiny", path=Path("."),
                       device=DEVICE, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


@pytest.fixture(scope="session")
def smol():
    from kvlens.engine.models import load_model

    return load_model("default", device=str(DEVICE), dtype="float32")


def model_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """`(T, vocab)` float logits of the model's own forward over `ids` (no kvlens run), on the model's device."""
    with torch.no_grad():
        return model.model(torch.tensor([ids], device=model.device)).logits[0].float()


@pytest.fixture(scope="session")
def long_text():
    return (TEXTS / "1961-Kennedy.txt").read_text()


def layer_rows(limit: int | None = None):
    """A standalone layer of a one-layer cache (the policy unit tests' cache); `limit` as in a run."""
    from kvlens.engine.cache import KVCache

    return KVCache(1, limit=limit).layers[0]


def shrink(policy, rows, budget: int | None, log=None, prompt: bool = False) -> None:
    """One compression of `rows` to `budget`: the prompt's (step 0) when `prompt`, else a decode step's."""
    from kvlens.engine.cache import Phase, Step

    policy.compress(rows, Step(0 if prompt else 1, Phase.PREFILL if prompt else Phase.DECODE, budget, log))
