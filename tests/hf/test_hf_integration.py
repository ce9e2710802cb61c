"""kvlens in the caller's own transformers code: `kvlens.cache` in `model.generate`, `kvlens.press`,
`kvlens.pipeline`.

The model is a plain `AutoModelForCausalLM.from_pretrained` object (SDPA attention, as a researcher loads it);
each policy's tokens and decision log must be exactly those of `kvlens generate`'s engine with the same
settings.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import kvlens
from kvlens import texts
from kvlens.engine.loop import RunOptions
from kvlens.errors import KvlensError
from kvlens.experiments.api import generate
from kvlens.experiments.bench import ruler
from kvlens.experiments.bench.common import PolicySpec
from kvlens.experiments.bench.tasks import plan_file, tasks_cell
from kvlens.policies import make_policy, policy_names
from kvlens.runs.run import load_run
from tests.conftest import DEVICE, within_budget

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
BUDGET = 0.5


@pytest.fixture(scope="module")
def hf():
    """The embedded model and tokenizer as a researcher loads them: transformers' own loader, default
    attention."""
    path = kvlens.model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def hf_prompt(long_text, hf):
    """About 300 tokens of a held-out speech."""
    _, tok = hf
    ids = tok(long_text).input_ids[:300]
    return tok.decode(ids)


def _ids(hf, text):
    return hf[1](text, return_tensors="pt").input_ids.to(DEVICE)


def _budget(name: str) -> dict:
    return {} if make_policy(name).budget_free else {"budget": BUDGET}


@pytest.mark.parametrize("name", policy_names())
def test_generate_with_a_kvlens_cache_is_kvlens_generate(name, hf, smol, hf_prompt):
    """Same tokens, same decision log, every registered policy; the model's attention is as it was
    afterwards."""
    model, tok = hf
    ids = _ids(hf, hf_prompt)
    cache = kvlens.cache(model, name, **_budget(name))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)
    opts = RunOptions(budget=_budget(name).get("budget"), max_new_tokens=NEW_TOKENS)
    ref = generate(smol, hf_prompt, name, opts=opts)
    assert out[0, ids.shape[1] :].tolist() == ref.meta.tokens
    pd.testing.assert_frame_equal(
        cache.decisions.reset_index(drop=True), ref.decisions.reset_index(drop=True)
    )
    run = cache.run(out)
    assert run.meta.tokens == ref.meta.tokens
    assert torch.equal(run.tensors["steps/kv_slots"], ref.tensors["steps/kv_slots"])
    assert model.config._attn_implementation == "sdpa"


def test_the_run_is_saved_for_the_app_and_reloads(hf, hf_prompt, tmp_path):
    model, _ = hf
    ids = _ids(hf, hf_prompt)
    cache = kvlens.cache(model, "snapkv", ratio=0.5, record="attention")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    path = cache.save_run(tmp_path / "mine", out)
    run = load_run(path)
    assert run.meta.tokens == out[0, ids.shape[1] :].tolist()
    assert run.meta.policy.name == "snapkv"
    assert run.meta.budget.slots == ids.shape[1] - int(ids.shape[1] * 0.5)  # kvpress's kept count
    assert len(run.decisions) == len(cache.decisions) > 0
    assert "attn/0" in run.tensors and within_budget(make_policy("snapkv"), run, run.meta.budget.slots)


def test_streamer_eos_and_seeded_sampling_work(hf, hf_prompt):
    model, tok = hf
    ids = _ids(hf, hf_prompt)
    greedy = model.generate(
        ids, past_key_values=kvlens.cache(model, "h2o", ratio=0.5), max_new_tokens=12, do_sample=False
    )[0, ids.shape[1] :]
    stop = int(greedy[4])  # end the generation at the 5th token's first appearance
    cache = kvlens.cache(model, "h2o", ratio=0.5)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, eos_token_id=stop)
    new = out[0, ids.shape[1] :].tolist()
    assert new[-1] == stop and stop not in new[:-1] and len(new) <= 5
    assert len(cache.run(out).meta.tokens) == len(new)

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            self.seen = getattr(self, "seen", "") + text

    streamer = Collect(tok, skip_prompt=True)
    out = model.generate(
        ids,
        past_key_values=kvlens.cache(model, "tova", ratio=0.5),
        max_new_tokens=8,
        do_sample=False,
        streamer=streamer,
    )
    assert streamer.seen == tok.decode(out[0, ids.shape[1] :])

    samples = []
    for _ in range(2):
        torch.manual_seed(7)
        cache = kvlens.cache(model, "streaming_llm", ratio=0.5)
        samples.append(
            model.generate(
                ids, past_key_values=cache, max_new_tokens=10, do_sample=True, temperature=1.0, top_k=0
            )[0, ids.shape[1] :].tolist()
        )
    assert samples[0] == samples[1]
    assert samples[0] != greedy[:10].tolist()  # sampled, not greedy


def test_press_runs_the_policy_in_every_generation_of_its_block(hf, hf_prompt):
    model, _ = hf
    ids = _ids(hf, hf_prompt)
    alone = kvlens.cache(model, "expected_attention", ratio=0.5)
    ref = model.generate(ids, past_key_values=alone, max_new_tokens=10, do_sample=False)
    with kvlens.press(model, "expected_attention", ratio=0.5) as caches:
        assert model.config._attn_implementation == "kvlens"
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref) and len(caches) == 1
    pd.testing.assert_frame_equal(caches[0].decisions, alone.decisions)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"policy": "nonesuch", "ratio": 0.5}, "Unknown policy 'nonesuch'"),
        ({"policy": "snapkv", "ratio": 1.0}, "ratio must be in [0, 1)"),
        ({"policy": "snapkv", "ratio": -0.1}, "ratio must be in [0, 1)"),
        ({"policy": "snapkv"}, "needs ratio="),
        ({"policy": "snapkv", "ratio": 0.5, "budget": 10}, "not both"),
    ],
)
def test_bad_settings_get_one_sentence_and_leave_the_model_alone(hf, kwargs, words):
    model, _ = hf
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    for make in (lambda: kvlens.cache(model, **kwargs), lambda: kvlens.press(model, **kwargs).__enter__()):
        with pytest.raises(KvlensError, match=re.escape(words)) as err:
            make()
        assert "\n" not in str(err.value)
        assert model.config._attn_implementation == "sdpa"
        assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks


def test_a_model_kvlens_refuses_is_refused_in_check_models_sentence():
    from kvlens.engine.architectures import inspect_model

    config = transformers.StableLmConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    before = model.config._attn_implementation
    with pytest.raises(KvlensError) as err:
        kvlens.cache(model, "full", tokenizer=object())
    with kvlens.attach(model):
        assert str(err.value) == inspect_model(model).refusal  # what `kvlens check-model` prints
    assert "never reaches kvlens" in str(err.value)
    assert model.config._attn_implementation == before and not model._forward_pre_hooks


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_beams": 2}, "holds one sequence"),
        ({"prompt_lookup_num_tokens": 3}, "several new tokens at once|cannot be cropped"),
    ],
)
def test_generate_modes_it_cannot_follow_are_refused(hf, hf_prompt, kwargs, words):
    model, _ = hf
    ids = _ids(hf, hf_prompt)
    with pytest.raises(KvlensError, match=words):
        model.generate(
            ids,
            past_key_values=kvlens.cache(model, "h2o", ratio=0.5),
            max_new_tokens=6,
            do_sample=False,
            **kwargs,
        )
    assert model.config._attn_implementation == "sdpa"


def test_a_batch_and_a_reused_cache_are_refused(hf, hf_prompt):
    model, tok = hf
    ids = _ids(hf, hf_prompt)
    with pytest.raises(KvlensError, match="batch of 2"):
        model.generate(
            ids.repeat(2, 1), past_key_values=kvlens.cache(model, "h2o", ratio=0.5), max_new_tokens=4
        )
    cache = kvlens.cache(model, "h2o", ratio=0.5)
    model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    other = _ids(hf, "An unrelated prompt about the sea and the ships on it, and the sailors.")
    with pytest.raises(KvlensError, match="already holds a generation"):
        model.generate(other, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == "sdpa"


def test_pipeline_answers_as_the_task_suite_does(hf, smol):
    """Two samples, three policies (one budget per head, one per layer shared by its heads, one with replay
    passes): `kvlens.pipeline`'s answers are those of `kvlens bench tasks --samples FILE --full-answers` (the
    task cell it runs), the question asked of the context compressed once."""
    model, tok = hf
    count = lambda s: len(smol.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    haystack = " ".join(texts.bundled().values())
    samples = [
        ruler.generate(task, 300, 0, count, haystack, seed=0) for task in ("niah_single", "niah_multikey")
    ]
    lines = "".join(json.dumps(s.to_json()) + "\n" for s in samples)
    policies = ["snapkv", "adakv", "kvzip"]
    cells = plan_file(
        samples,
        [PolicySpec.parse(p) for p in policies],
        [0.5],
        model="default",
        query_aware=False,
        chat=True,
        text=lines,
        stop_when_found=False,
    )
    pipe = kvlens.pipeline(model, tok)
    for sample, cell in zip(samples, cells, strict=True):
        suite = {r["policy"]: r["outputs"] for r in tasks_cell(smol, {"samples": lines}, cell)["results"]}
        for policy in policies:
            got = pipe(
                sample.context,
                questions=list(sample.questions),
                policy=policy,
                ratio=0.5,
                max_new_tokens=sample.max_new_tokens,
            )
            assert got["answers"] == suite[policy], policy
