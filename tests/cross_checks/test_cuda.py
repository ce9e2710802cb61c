"""On a CUDA GPU (`make test-cuda`; deselected elsewhere): the embedded model on the GPU is the CPU's model.

fp32 on the GPU must take the CPU's decisions and match its numbers within float rounding; bf16 (the GPU
default, `--dtype auto`) must reproduce transformers' own bf16 forward within bf16 rounding and run every
registered policy within its budget, with keys and values stored in 2 bytes. The rest of the engine's tests
run on the GPU too, with KVLENS_TEST_DEVICE=cuda (see the Makefile).
"""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.loop import RunOptions, run
from kvlens.engine.models import load_model
from kvlens.policies import make_policy, policy_names
from tests.conftest import model_logits

pytestmark = pytest.mark.cuda  # deselected where torch sees no CUDA GPU (tests/conftest.py)

PREFILL, STEPS, BUDGET = 384, 64, 96
DECIDING = ["streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "expected_attention", "cam"]


@pytest.fixture(scope="module")
def models():
    """The embedded model three times: CPU fp32, CUDA fp32, CUDA bf16."""
    return {
        (dev, dt): load_model("default", device=dev, dtype=dt)
        for dev, dt in [("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")]
    }


@pytest.fixture(scope="module")
def smol_ids(models, long_text):
    return models["cpu", "float32"].tokenizer(long_text).input_ids[: PREFILL + STEPS]


def _teacher(model, name, ids, budget=BUDGET):
    logits = []
    r = run(
        model,
        make_policy(name),
        ids,
        prefill=PREFILL,
        steps=STEPS,
        teacher=True,
        opts=RunOptions(budget=None if name == "full" else budget),
        on_step=lambda e: logits.append(e.logits.float().cpu()),
    )
    return r, torch.stack(logits)


def _removed(r) -> set[tuple]:
    """(step, layer, KV head, position) of every slot that left the cache: evicted, or merged away (CaM)."""
    d = r.decisions
    d = d[d["action"].isin(["evict", "merge"])]
    return set(zip(d["step"], d["layer"], d["kv_head"], d["position"]))


def test_fp32_on_the_gpu_is_the_cpus_model(models, smol_ids):
    cpu, gpu = models["cpu", "float32"], models["cuda", "float32"]
    want = model_logits(cpu, smol_ids)
    assert (model_logits(gpu, smol_ids).cpu() - want).abs().max() <= 1e-3 * want.abs().max()
    r_cpu, l_cpu = _teacher(cpu, "full", smol_ids)
    r_gpu, l_gpu = _teacher(gpu, "full", smol_ids)
    assert (l_gpu - l_cpu).abs().max() <= 1e-3 * l_cpu.abs().max()
    assert abs(r_gpu.metrics["nll"] - r_cpu.metrics["nll"]) <= 1e-4 * r_cpu.metrics["nll"]


@pytest.mark.parametrize("name", DECIDING)
def test_fp32_on_the_gpu_takes_the_cpus_decisions(models, smol_ids, name):
    r_cpu, l_cpu = _teacher(models["cpu", "float32"], name, smol_ids)
    r_gpu, l_gpu = _teacher(models["cuda", "float32"], name, smol_ids)
    cpu, gpu = _removed(r_cpu), _removed(r_gpu)
    assert cpu, "the policy removed nothing"
    assert len(cpu ^ gpu) <= 0.001 * len(cpu), f"{len(cpu ^ gpu)} of {len(cpu)} removals differ"
    assert abs(r_gpu.metrics["nll"] - r_cpu.metrics["nll"]) <= 1e-3 * r_cpu.metrics["nll"]


def test_bf16_full_is_transformers_own_bf16_forward(models, smol_ids):
    bf16 = models["cuda", "bfloat16"]
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(bf16.path, dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.no_grad():
        want = eager.to("cuda").eval()(torch.tensor([smol_ids], device="cuda")).logits[0].float().cpu()
    want = want[PREFILL - 1 : PREFILL + STEPS - 1]
    r, got = _teacher(bf16, "full", smol_ids)
    fp32 = _teacher(models["cpu", "float32"], "full", smol_ids)[0].metrics["nll"]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    assert abs(r.metrics["nll"] - fp32) <= 0.02 * fp32  # bf16's perplexity is the fp32 model's within 2 %


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_runs_in_bf16_within_its_budget(models, smol_ids, name):
    bf16 = models["cuda", "bfloat16"]
    policy = make_policy(name)
    budget = max(BUDGET, policy.needs().min_budget)
    r = run(
        bf16, policy, smol_ids, prefill=PREFILL, steps=STEPS, teacher=True, opts=RunOptions(budget=budget)
    )
    assert torch.isfinite(torch.tensor(r.metrics["nll"]))
    shape = bf16.shape()
    if not policy.budget_free:
        assert r.metrics["kv_entries_max"] == budget * shape["layers"] * shape["kv_heads"]
    per_slot = 2 * shape["kv_heads"] * shape["head_dim"] * 2  # K and V in bf16
    assert r.metrics["kv_bytes_prefill"] == shape["layers"] * PREFILL * per_slot


@pytest.mark.parametrize("name", ["snapkv", "cam"])
def test_the_transformers_example_runs_in_bf16(models, smol_ids, name, tmp_path):
    """The README's `kvlens.cache` example on the caller's own bf16 model on the GPU: the tokens and decisions
    of `kvlens generate` on the same bf16 model, and a run directory that reloads."""
    from transformers import AutoModelForCausalLM

    import kvlens
    from kvlens.experiments.api import generate
    from kvlens.runs.run import load_run

    bf16 = models["cuda", "bfloat16"]
    model = AutoModelForCausalLM.from_pretrained(bf16.path, dtype=torch.bfloat16).to("cuda").eval()
    text = bf16.tokenizer.decode(smol_ids[:PREFILL])
    prompt = bf16.tokenizer(text, return_tensors="pt").input_ids.to("cuda")
    cache = kvlens.cache(model, name, budget=BUDGET, tokenizer=bf16.tokenizer)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=32, do_sample=False)
    ref = generate(bf16, text, name, opts=RunOptions(budget=BUDGET, max_new_tokens=32))
    assert out[0, prompt.shape[1] :].tolist() == ref.meta.tokens
    assert cache.decisions.reset_index(drop=True).equals(ref.decisions.reset_index(drop=True))
    saved = load_run(cache.save_run(tmp_path / "mine", out))
    assert saved.meta.tokens == ref.meta.tokens
