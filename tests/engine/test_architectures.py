"""Architecture matrix: on every common decoder family kvlens' `full` is the model, or the model is refused.

Tiny random models (2 layers, GQA where the family has it, hidden size 32) are built from
transformers config classes, saved with a byte-level tokenizer and loaded through `load_model`
like any user model. The reference is the same directory loaded with transformers' own `eager`
attention. With KVLENS_SUPPORT_TABLE=path the measured differences are written there as the
support table of docs/support.md (`scripts/support_table.py`).
"""

from __future__ import annotations

import json
import math
import os
import types
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvlens.cli import main
from kvlens.engine.architectures import inspect_model
from kvlens.engine.attention import kvlens_attention
from kvlens.engine.loop import RunOptions, run
from kvlens.engine.models import load_model
from kvlens.errors import KvlensError
from kvlens.policies import REGISTRY, make_policy
from tests.conftest import DEVICE, within_budget, write_scorer

PREFILL, STEPS = 40, 40  # 80 tokens: five times the sliding windows below
WINDOW = 16
TOLERANCE = 1e-5  # relative, fp32
BUDGET = 12
INIT = 0.3  # weights' std: large enough that attention is far from uniform and a soft-cap of 5 bites
SOFTCAP = 5.0
EOS = 256
BASE = dict(
    vocab_size=EOS + 1,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
    initializer_range=INIT,
)
GQA = dict(BASE, num_key_value_heads=2)
GEMMA = dict(GQA, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=12)
GEMMA_SCALE = 12**-0.5  # query_pre_attn_scalar ** -0.5

# name -> (config class, config arguments, what the probe must find, features for the table)
MATRIX = {
    "llama": ("LlamaConfig", GQA, {}, "GQA, RoPE"),
    "mistral": (
        "MistralConfig",
        dict(GQA, sliding_window=WINDOW),
        {"sliding": {0: WINDOW, 1: WINDOW}},
        f"GQA, RoPE, sliding window {WINDOW} on every layer",
    ),
    "qwen2": ("Qwen2Config", GQA, {}, "GQA, RoPE, q/k/v biases"),
    "qwen2 (sliding layers)": (
        "Qwen2Config",
        dict(GQA, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        {"sliding": {1: WINDOW}},
        f"GQA, RoPE, q/k/v biases, window {WINDOW} on layer 1",
    ),
    "qwen3": ("Qwen3Config", dict(GQA, head_dim=8), {}, "GQA, RoPE, q/k norms"),
    "gemma2": (
        "Gemma2Config",
        dict(GEMMA, attn_logit_softcapping=SOFTCAP, final_logit_softcapping=30.0),
        {"sliding": {0: WINDOW}, "softcap": {0: SOFTCAP, 1: SOFTCAP}, "scaling": [GEMMA_SCALE] * 2},
        f"GQA, RoPE, attention logit soft-capping {SOFTCAP:g}, window {WINDOW} on layer 0 (global layer 1), "
        f"query_pre_attn_scalar 12",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(GEMMA, layer_types=["sliding_attention", "full_attention"]),
        {"sliding": {0: WINDOW}, "scaling": [GEMMA_SCALE] * 2},
        f"GQA, RoPE (local and global bases), q/k norms, window {WINDOW} on layer 0, "
        "query_pre_attn_scalar 12",
    ),
    "phi3": ("Phi3Config", GQA, {}, "GQA, RoPE, fused qkv"),
    "olmo2": ("Olmo2Config", GQA, {}, "GQA, RoPE, q/k norms"),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(BASE, rotary_pct=0.25),
        {"positions": "rotary on 25% of each head"},
        "partial RoPE (25%), parallel residual",
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=EOS + 1,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            eos_token_id=EOS,
            bos_token_id=None,
            initializer_range=INIT,
        ),
        {"positions": "no rotary embedding"},
        "learned absolute positions, no RoPE",
    ),
}
GEMMA3N = dict(
    GQA,
    head_dim=8,
    num_hidden_layers=4,
    num_kv_shared_layers=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    intermediate_size=[64] * 4,
    activation_sparsity_pattern=[0.0] * 4,
    laurel_rank=4,
    altup_num_inputs=2,
    hidden_size_per_layer_input=4,
    vocab_size_per_layer_input=EOS + 1,
)
REFUSED = {
    "gpt_oss": (
        "GptOssConfig",
        dict(GQA, head_dim=8, num_local_experts=2, num_experts_per_tok=1),
        "learned attention sinks",
        "learned attention sinks (`s_aux`)",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            BASE,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
        ),
        "multi-latent attention",
        "multi-latent attention",
    ),
    "gpt2 with cross-attention": (
        "GPT2Config",
        dict(MATRIX["gpt2"][1], add_cross_attention=True),
        "cross-attention",
        "cross-attention layers",
    ),
    "mamba": (
        "MambaConfig",
        dict(
            vocab_size=EOS + 1,
            hidden_size=32,
            state_size=4,
            num_hidden_layers=2,
            eos_token_id=EOS,
            bos_token_id=None,
            pad_token_id=None,
        ),
        "Layer 0 is a linear attention layer",
        "state-space layers, no KV cache",
    ),
    "llama4 (text)": (
        "Llama4TextConfig",
        dict(
            GQA,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=1,
            attention_chunk_size=8,
            no_rope_layers=[1, 0],
            moe_layers=[],
        ),
        "Layer 0 is a chunked attention layer",
        "chunked attention (in the mask only)",
    ),
    "gemma3n (text)": (
        "Gemma3nTextConfig",
        GEMMA3N,
        "Layer 2 does not keep its own keys and values",
        "layers 2-3 reuse earlier layers' KV cache",
    ),
    "stablelm": (
        "StableLmConfig",
        GQA,
        "Layer 0's attention never reaches kvlens",
        "its decoder layer does not pass keyword arguments on to the attention function",
    ),
    "gptj": (
        "GPTJConfig",
        dict(
            vocab_size=EOS + 1,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=256,
            eos_token_id=EOS,
            bos_token_id=None,
        ),
        "hard-codes its attention classes",
        "attention classes fixed in its transformers code",
    ),
}
RESULTS: dict[str, dict] = {}


def byte_tokenizer():
    """Byte-level BPE with no merges: one token per byte, id 256 = eos."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|eos|>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


def save_tiny(directory: Path, config_class: str, kwargs: dict) -> Path:
    """A random-init model of `config_class(**kwargs)` and the byte tokenizer, saved into `directory`."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """`family_dir(name)`: the saved directory of a MATRIX or REFUSED model, built once per module."""
    root = tmp_path_factory.mktemp("architectures")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            config_class, kwargs = (MATRIX.get(name) or REFUSED[name])[:2]
            made[name] = save_tiny(root / name.replace(" ", "_"), config_class, kwargs)
        return made[name]

    return get


@pytest.fixture(scope="module")
def loaded(family_dir):
    """`loaded(name)`: the MATRIX model through `load_model` (fp32, on the test device: CPU unless
    KVLENS_TEST_DEVICE), loaded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(str(family_dir(name)), device=str(DEVICE), dtype="float32")
        return cache[name]

    return get


@pytest.fixture(scope="module")
def llama_ids(loaded, long_text):
    return loaded("llama").tokenizer(long_text).input_ids[: PREFILL + STEPS]


def _engine(lm, ids, policy="full", **opts):
    logits = []
    r = run(
        lm,
        make_policy(policy),
        ids,
        prefill=PREFILL,
        steps=STEPS,
        teacher=True,
        opts=RunOptions(**opts),
        on_step=lambda e: logits.append(e.logits.float().cpu()),
    )
    return r, torch.stack(logits)


@pytest.mark.parametrize("name", list(MATRIX))
def test_full_is_the_models_own_forward(name, loaded, family_dir, llama_ids):
    lm = loaded(name)
    for key, want in MATRIX[name][2].items():
        assert getattr(lm.support, key) == want, key  # the probe read the layer's arguments
    eager = (
        transformers.AutoModelForCausalLM.from_pretrained(
            family_dir(name), dtype=torch.float32, attn_implementation="eager"
        )
        .eval()
        .to(DEVICE)
    )
    with torch.no_grad():
        want = eager(torch.tensor([llama_ids], device=DEVICE)).logits[0].float().cpu()
        plain = (
            lm.model(torch.tensor([llama_ids], device=DEVICE)).logits[0].float().cpu()
        )  # kvlens' function alone
    scored = want[PREFILL - 1 : PREFILL + STEPS - 1]
    loss = float(torch.nn.functional.cross_entropy(scored, torch.tensor(llama_ids[PREFILL:])))
    scale = float(want.abs().max())
    diffs = {"plain forward": float((plain - want).abs().max()) / scale}
    for record in ("summary", "full"):  # "full" computes every attention row: prefill_stats and decode_rows
        r, got = _engine(lm, llama_ids, record=record)
        diffs[f"logits, record {record}"] = float((got - scored).abs().max()) / scale
        diffs[f"nll, record {record}"] = abs(r.metrics["nll"] - loss) / loss
    RESULTS[name] = {"max_rel": max(diffs.values()), "support": lm.support}
    assert max(diffs.values()) <= TOLERANCE, diffs


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_ppl_command_equals_the_models_own_loss(name, family_dir, long_text, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(long_text[: PREFILL + STEPS])  # one token per byte
    capsys.readouterr()
    assert (
        main(
            [
                "ppl",
                "--policy",
                "full",
                "--model",
                str(family_dir(name)),
                "--text-file",
                str(text),
                "--prefill",
                str(PREFILL),
                "--tokens",
                str(STEPS),
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    nll = json.loads(capsys.readouterr().out)["nll"]
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        family_dir(name), attn_implementation="eager"
    ).eval()
    ids = transformers.AutoTokenizer.from_pretrained(family_dir(name))(text.read_text()).input_ids
    assert len(ids) == PREFILL + STEPS
    with torch.no_grad():
        logits = eager(torch.tensor([ids])).logits[0, PREFILL - 1 : -1]
    loss = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[PREFILL:])))
    assert abs(nll - loss) / loss <= TOLERANCE


# what a policy needs that an architecture lacks: Expected Attention one RoPE on every layer (gpt2 has none,
# gpt_neox a partial one, gemma3 two), KVzip's replay pass the whole prompt in view (no sliding window)
REFUSALS = {
    **{("expected_attention", n): "rotary embedding" for n in ("gpt2", "gpt_neox", "gemma3")},
    **{("kvzip", n): "sliding-window" for n in ("mistral", "qwen2 (sliding layers)", "gemma2", "gemma3")},
    **{("kvzap", n): "no `o_proj`" for n in ("gpt_neox", "gpt2")},  # KVzap reads the attention's input there
}
# windows that fit the matrix's 40-token prompts (their defaults, 64, need longer ones)
SMALL_PROMPT = {
    "snapkv": {"window": 4},
    "pyramidkv": {"window": 4, "base.window": 4},
    "adakv": {"base.window": 4},
    "think": {"base.window": 4, "window": 4},
}


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_policy_runs_within_its_budget(name, loaded, llama_ids, tmp_path):
    """Every registered policy runs on every architecture; a policy that needs what a model lacks (`REFUSALS`)
    is refused in one sentence. Each keeps its budget: every layer and head,
    or, for a policy whose selection spans heads or layers, the total over layers and heads."""
    lm = loaded(name)
    small = {**SMALL_PROMPT, "kvzap": {"scorer": str(write_scorer(lm, tmp_path / "scorer.safetensors"))}}
    for policy, cls in REGISTRY.items():
        budget = None if cls().budget_free else BUDGET
        try:
            r = run(
                lm,
                make_policy(policy, small.get(policy, {})),
                llama_ids,
                prefill=PREFILL,
                steps=6,
                teacher=True,
                opts=RunOptions(budget=budget),
            )
        except KvlensError as err:
            assert (policy, name) in REFUSALS and REFUSALS[policy, name] in str(err), (policy, name, str(err))
            continue
        assert math.isfinite(r.metrics["nll"]), policy
        if budget is not None:
            assert within_budget(make_policy(policy, small.get(policy, {})), r, budget), policy


def test_sliding_layer_attends_only_its_window(loaded, llama_ids):
    """Kept slots older than the window get exactly zero attention; the window's slots get all of it."""
    r, _ = _engine(loaded("mistral"), llama_ids, "h2o", budget=2 * WINDOW, record="full")
    attn, pos = (
        r.tensors["attn/0"].float(),
        r.tensors["attn_pos/0"],
    )  # (steps, Hq, S) stored fp16, (steps, Hkv, S)
    group = attn.shape[1] // pos.shape[1]
    pos = pos.repeat_interleave(group, 1).long()
    query = PREFILL - 1 + torch.arange(attn.shape[0])[:, None, None]  # row k: the token at PREFILL - 1 + k
    inside = (pos >= 0) & (query - pos < WINDOW)
    outside = (pos >= 0) & ~inside
    assert bool(outside[-1].any())  # the budget keeps slots the window hides
    assert float(attn[outside].abs().max()) == 0.0
    assert torch.allclose((attn * inside).sum(-1), torch.ones(attn.shape[:2]), atol=2e-3)


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_models_are_refused_before_running(name, family_dir, long_text, tmp_path, capsys):
    with pytest.raises(KvlensError, match=REFUSED[name][2]) as err:
        load_model(str(family_dir(name)), device="cpu", dtype="float32")
    sentence = str(err.value)
    assert "\n" not in sentence and sentence.endswith(".")
    RESULTS[name] = {"refusal": sentence}
    text = tmp_path / "text.txt"
    text.write_text(long_text[:400])
    capsys.readouterr()
    assert (
        main(
            [
                "ppl",
                "--policy",
                "full",
                "--model",
                str(family_dir(name)),
                "--text-file",
                str(text),
                "--prefill",
                "8",
                "--tokens",
                "4",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == f"kvlens: error: {sentence}"
    code = main(["check-model", "--model", str(family_dir(name)), "--device", "cpu", "--json"])
    out = capsys.readouterr()
    if code == 1:  # loaded, and reported
        assert json.loads(out.out)["refusal"] == sentence
    else:  # transformers cannot even load it with kvlens' attention
        assert code == 2 and out.err.strip() == f"kvlens: error: {sentence}"


def test_the_engine_refuses_a_model_loaded_only_to_be_reported(family_dir):
    lm = load_model(str(family_dir("gpt_oss")), device="cpu", dtype="float32", refuse=False)
    with pytest.raises(KvlensError, match=REFUSED["gpt_oss"][2]):
        run(lm, make_policy("full"), list(range(12)), prefill=8, steps=4, teacher=True, opts=RunOptions())


def test_check_model_reports_what_the_layers_ask_for(family_dir, capsys):
    assert main(["check-model", "--model", str(family_dir("gemma2")), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "gemma2" and report["verdict"] == "exact"
    assert report["sliding"] == {"0": WINDOW} and report["softcap"] == {"0": SOFTCAP, "1": SOFTCAP}
    assert report["kv_heads"] == 2 and report["positions"] == "rotary"
    assert main(["check-model", "--model", str(family_dir("gpt2")), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "no rotary embedding" in out and "verdict      exact" in out


class _Layer(torch.nn.Module):
    layer_idx = 3


class _TwoLayers(torch.nn.Module):
    """A stand-in decoder whose layers call kvlens' attention as told: `calls` per layer, `update` the cache
    or not."""

    def __init__(self, layer_types, window=None, calls=(1, 1), update=(True, True)):
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=2, layer_types=layer_types)
        self.attn = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(2))
        for i, layer in enumerate(self.attn):
            layer.layer_idx = i
        self.window, self.calls, self.update = window, calls, update

    def forward(self, input_ids, past_key_values, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k == "kvlens_context"}
        for i, layer in enumerate(self.attn):
            q = k = torch.randn(1, 2, input_ids.shape[1], 4)
            if self.update[i]:
                k, _ = past_key_values.update(k, k, i)
            for _ in range(self.calls[i]):
                kvlens_attention(layer, q, k, k, None, sliding_window=self.window, **kwargs)


@pytest.mark.parametrize(
    "model, words",
    [
        (
            _TwoLayers(["sliding_attention", "full_attention"]),
            "Layer 0 is a sliding-window layer that passes no window",
        ),
        (_TwoLayers(["full_attention"] * 2, calls=(1, 2)), "Layer 1 attends 2 times per token"),
        (
            _TwoLayers(["full_attention"] * 2, update=(True, False)),
            "Layer 1 does not keep its own keys and values",
        ),
    ],
)
def test_probe_refuses_layers_it_cannot_follow(model, words):
    assert words in inspect_model(model).refusal
    assert inspect_model(_TwoLayers(["sliding_attention"] * 2, window=4)).sliding == {0: 4, 1: 4}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"frobnicate": 1.0}, "layer 3 uses the attention argument `frobnicate`"),
        ({"s_aux": torch.zeros(4)}, "layer 3 uses learned attention sinks"),
        ({"is_causal": False}, "layer 3 is not causal"),
        ({"dropout": 0.1}, "layer 3 applies dropout"),
    ],
)
def test_attention_arguments_it_cannot_honour_are_refused(kwargs, words):
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8)
    with pytest.raises(KvlensError, match=words):
        kvlens_attention(_Layer(), q, k, k, None, scaling=0.3, **kwargs)


def test_keys_of_another_width_are_refused():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 6)
    with pytest.raises(KvlensError, match="different widths"):
        kvlens_attention(_Layer(), q, k, v, None, scaling=0.3)


def support_table() -> str:
    """docs/support.md's table, from this module's results (every MATRIX and REFUSED model must have run)."""
    rows = [
        "| architecture | verdict | features exercised | max. rel. difference to the model (fp32) |",
        "|---|---|---|---|",
    ]
    for name, (_, _, _, features) in MATRIX.items():
        rel = RESULTS[name]["max_rel"]
        rows.append(f"| {name} | {'exact' if rel <= TOLERANCE else 'NOT EXACT'} | {features} | {rel:.1e} |")
    for name, (_, _, _, feature) in REFUSED.items():
        rows.append(f'| {name} | refused | {feature}: "{RESULTS[name]["refusal"]}" | - |')
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module", autouse=True)
def write_support_table():
    yield
    target = os.environ.get("KVLENS_SUPPORT_TABLE")
    if target and set(MATRIX) | set(REFUSED) <= set(RESULTS):
        Path(target).write_text(support_table())


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_measured_perturbation_follows_the_layers_window_and_softcap(name, loaded, llama_ids):
    """`--measure` recomputes attention as the layer does: zero for `full`, used == evict without merging."""
    from kvlens.engine.perturbation import measured

    lm = loaded(name)

    def measure(policy):
        def go(observers, on_step):
            opts = RunOptions(budget=None if policy == "full" else BUDGET)
            return run(
                lm,
                make_policy(policy),
                llama_ids,
                prefill=PREFILL,
                steps=STEPS,
                teacher=True,
                observers=observers,
                on_step=on_step,
                opts=opts,
            )

        return measured(lm, go)

    full = measure("full")
    for kind in ("used", "evict", "attention_loss"):
        assert float(full.tensors[f"perturbation/{kind}"].abs().max()) < 1e-5, kind
    evicting = measure("streaming_llm")
    torch.testing.assert_close(
        evicting.tensors["perturbation/used"], evicting.tensors["perturbation/evict"], atol=1e-5, rtol=1e-4
    )
    assert evicting.metrics["perturbation_used"] > 0.01
