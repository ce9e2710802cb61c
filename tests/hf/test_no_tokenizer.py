"""`kvlens.cache` on a model built in code: no name, no path, no tokenizer and no network.

A tokenizer is asked for only where a policy (KVzip, Q-Filters) or a call (run files, the pipeline) needs
one, in one sentence and at once; nothing contacts a hub (every socket connection raises here).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvlens
from kvlens.errors import KvlensError


@pytest.fixture
def built():
    """A small Llama built from its config (random weights): no `name_or_path`, no tokenizer beside it."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    assert not model.name_or_path
    return model


def test_h2o_generates_on_a_model_built_from_a_config_with_no_tokenizer_and_no_network(built, no_network):
    ids = torch.randint(0, 128, (1, 40))
    cache = kvlens.cache(built, "h2o", ratio=0.5)
    out = built.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert no_network == []
    assert out.shape == (1, 46)
    evicted = cache.decisions.groupby(["layer", "kv_head"]).size()
    fed = 40 + 5  # the prompt, then every generated token but the last
    assert len(evicted) == 2 * 2 and (evicted == fed - 20).all()  # each KV head holds its budget, 20


@pytest.mark.parametrize("policy", ["kvzip", "qfilter"])
def test_a_policy_that_needs_a_tokenizer_asks_for_it_at_once(built, no_network, policy):
    with pytest.raises(KvlensError) as err:
        kvlens.cache(built, policy, ratio=0.5)
    assert str(err.value).startswith(f"Policy {policy} needs the model's tokenizer")
    assert "\n" not in str(err.value) and not built._forward_pre_hooks


def test_run_files_and_the_pipeline_ask_for_a_tokenizer(built, no_network, tmp_path):
    cache = kvlens.cache(built, "streaming_llm", ratio=0.5)
    out = built.generate(torch.arange(30)[None], past_key_values=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(KvlensError, match=r"^A run's files .* needs the model's tokenizer"):
        cache.save_run(tmp_path / "run", out)
    with pytest.raises(KvlensError, match=r"^kvlens.pipeline needs the model's tokenizer"):
        kvlens.pipeline(built)
