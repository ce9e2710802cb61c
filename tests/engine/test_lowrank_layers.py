"""Low-rank storage's options (`kvlens.kvcache.lowrank`): xKV's cross-layer groups (one SVD of the
concatenated heads of adjacent layers, the coefficients stored once), later tokens at full width, quantized
coefficients, the byte share as the rank's target, and incompatible combinations refused in one sentence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvlens.engine.loop import RunOptions
from kvlens.errors import KvlensError
from kvlens.experiments.api import perplexity
from kvlens.experiments.bench import ruler, tasks
from kvlens.experiments.bench.common import parse_policies
from kvlens.kvcache.lowrank import seal_cross_layer
from kvlens.kvcache.quantize import Storage
from kvlens.kvcache.rank import fit_rank
from tests.engine.conftest import TEXT, keys_like

PREFILL, TOKENS = 200, 24
SLOTS, FED = (
    PREFILL + TOKENS - 1,
    TOKENS - 1,
)  # the tiny run's last cache, and the tokens fed after the prompt
ROWS = 3 * 2  # the tiny model's layers x KV heads (head size 16, float32)


def run(tiny, policy="full", budget=None, **storage):
    return perplexity(
        tiny,
        TEXT,
        policy,
        prefill=PREFILL,
        tokens=TOKENS,
        opts=RunOptions(budget=budget, storage=Storage(**storage)),
    )


@pytest.mark.parametrize("rank", [1, 5, 20])
def test_xkv_reconstructs_the_concatenated_layers_with_the_discarded_singular_values_energy(rank):
    layers = [keys_like(30, seed) for seed in range(2)]  # two layers of 3 KV heads, (3, 30, 16) each
    valid = torch.ones(30, dtype=torch.bool)
    parts = seal_cross_layer(rank, layers, valid)
    error = sum(float(((p.read(slice(0, 3), 30) - x) ** 2).sum()) for p, x in zip(parts, layers, strict=True))
    joined = torch.cat([x.transpose(0, 1).reshape(30, 48) for x in layers], 1)  # (n, G x Hkv x D)
    sigma = np.linalg.svd(joined.double().numpy(), compute_uv=False)
    assert error == pytest.approx(float((sigma[rank:] ** 2).sum()), rel=1e-4)
    assert parts[0].coef is parts[1].coef  # one tensor of coefficients for the group
    assert parts[0].nbytes(3) + parts[1].nbytes(3) == (30 * rank + 2 * 3 * 16 * rank) * 4


def test_xkv_at_full_rank_is_the_uncompressed_cache_and_its_bytes_count_the_coefficients_once(tiny):
    plain = run(tiny)
    whole = run(tiny, rank=96, rank_layers=3, rank_append="full")  # 3 layers x 2 heads x 16 channels
    assert torch.allclose(whole.tensors["steps/nll"], plain.tensors["steps/nll"], atol=1e-4)
    ranked = run(tiny, rank=8, rank_layers=3, rank_append="full")
    per_group = PREFILL * 8 + ROWS * 16 * 8 + ROWS * FED * 16  # coefficients, bases, the later tokens
    assert ranked.metrics["kv_bytes_peak"] == 2 * per_group * 4


def test_later_tokens_at_full_width_cost_their_bytes_and_are_held_exactly(tiny):
    projected, full = run(tiny, rank=4), run(tiny, rank=4, rank_append="full")
    assert full.metrics["kv_bytes_peak"] == 2 * ROWS * (PREFILL * 4 + 16 * 4 + FED * 16) * 4
    assert projected.metrics["kv_bytes_peak"] == 2 * ROWS * (SLOTS * 4 + 16 * 4) * 4
    assert not torch.allclose(full.tensors["steps/nll"], projected.tensors["steps/nll"], atol=1e-3)


def test_quantized_coefficients_cost_their_codes_and_scales(tiny):
    plain = run(tiny)
    eight = run(tiny, rank=16, bits=8)  # every channel, coefficients at 8 bits: one group of 16 a token
    assert eight.meta.storage["bits"] == 8
    assert eight.metrics["kv_bytes_peak"] == 2 * ROWS * (SLOTS * (16 + 4) + 16 * 16 * 4)
    assert torch.allclose(eight.tensors["steps/nll"], plain.tensors["steps/nll"], atol=0.05)
    four = run(tiny, rank_share=0.5, bits=4)
    assert four.metrics["kv_bytes_peak"] <= plain.metrics["kv_bytes_peak"] / 2


@pytest.mark.parametrize(
    "storage, rank",
    [
        ({}, 14),  # the largest r with r x (575 + 64) <= 0.25 x 575 x 64
        ({"rank_append": "full"}, 8),  # 512 x r + 64 x r + 63 x 64 <= 0.25 x 575 x 64
        ({"bits": 4}, 62),  # 575 x (r / 2 + 4) + 256 x r <= 0.25 x 575 x 256, r even
    ],
)
def test_the_rank_share_is_the_largest_rank_whose_bytes_fit_that_share(storage, rank):
    s = Storage(rank_share=0.25, **storage)
    assert fit_rank(s, 64, 1, 575, 512, 4) == rank


@pytest.mark.parametrize("share", [0.5, 0.25])
@pytest.mark.parametrize(
    "storage", [{}, {"rank_append": "full"}, {"rank_layers": 3, "rank_append": "full"}, {"bits": 4}]
)
def test_a_run_at_a_rank_share_stores_at_most_that_share_of_the_full_caches_bytes(tiny, share, storage):
    full = run(tiny).metrics["kv_bytes_peak"]
    assert run(tiny, rank_share=share, **storage).metrics["kv_bytes_peak"] <= share * full


def test_xkv_is_refused_in_one_sentence_when_heads_keep_different_tokens(tiny):
    with pytest.raises(KvlensError, match=r"every head must keep the same tokens"):
        run(tiny, "h2o", 64, rank=8, rank_layers=3, rank_append="full")


def test_eviction_with_later_tokens_at_full_width_keeps_its_decisions(tiny):
    plain, ranked = run(tiny, "h2o", 64), run(tiny, "h2o", 64, rank=16, rank_append="full")
    assert plain.decisions.equals(ranked.decisions)  # full rank: every slot as it was
    assert torch.allclose(ranked.tensors["steps/nll"], plain.tensors["steps/nll"], atol=1e-4)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"rank_layers": 2}, "need low-rank storage"),
        ({"rank_append": "full"}, "need low-rank storage"),
        ({"rank": 4, "rank_layers": 0, "rank_append": "full"}, "--kv-rank-layers must be at least 1"),
        ({"rank": 4, "rank_append": "wide"}, "--kv-rank-append must be one of project, full"),
        ({"rank": 4, "rank_layers": 2}, "needs --kv-rank-append full"),
        ({"rank": 4, "bits": 4, "residual": 64}, "--kv-residual does not apply to low-rank storage"),
    ],
)
def test_an_incompatible_combination_gets_one_sentence(settings, words):
    with pytest.raises(KvlensError, match=words):
        Storage(**settings)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"rank": 3, "bits": 4}, r"pick a multiple of 2 \(to pack at 4 bits\), at most the group"),
        (
            {"rank": 12, "bits": 8, "group": 8},
            "groups of --kv-group 8: pick at most the group or a multiple of it",
        ),
        ({"rank": 97, "rank_layers": 3, "rank_append": "full"}, "above the 3 layers' channels"),
    ],
)
def test_a_rank_that_does_not_fit_the_model_or_its_bits_is_refused_before_running(tiny, settings, words):
    with pytest.raises(KvlensError, match=words):
        run(tiny, **settings)


def test_xkv_answers_a_task_as_the_full_cache_does_at_full_rank(tiny_dir):
    """The task protocol compresses the context once, then appends and forgets each question
    (`mark`/`rewind`): the shared coefficients survive both."""
    from kvlens.engine.models import load_model

    model = load_model(str(tiny_dir))
    sample = {
        "context": "The code word is amber. " * 20,
        "question": ["What is the code word?", "And again?"],
        "answers": [["amber"], ["amber"]],
        "task": "mine",
        "max_new_tokens": 4,
    }
    text = json.dumps(sample) + "\n"
    cell = tasks.plan_file(
        ruler.parse_lines(text),
        parse_policies("full"),
        [],
        model="tiny",
        query_aware=False,
        chat=False,
        text=text,
    )[0]
    plain = tasks.tasks_cell(model, {"samples": text}, cell)
    layers = model.shape()
    width = layers["layers"] * layers["kv_heads"] * layers["head_dim"]
    whole = tasks.tasks_cell(
        model,
        {"samples": text},
        {**cell, "storage": Storage(rank=width, rank_layers=layers["layers"], rank_append="full").describe()},
    )
    assert whole["results"][0]["outputs"] == plain["results"][0]["outputs"]
    assert whole["results"][0]["nll"] == pytest.approx(plain["results"][0]["nll"], abs=1e-4)


@pytest.mark.parametrize("append", ["project", "full"])
def test_a_chunked_prefill_carries_low_rank_slots_into_each_new_layout(tiny, append):
    """Each chunk's compression moves the kept slots into new buffers (`take`): at full rank the run is the
    model-dtype one, full-width slots included."""

    def chunked(**storage):
        return perplexity(
            tiny,
            TEXT,
            "h2o",
            prefill=PREFILL,
            tokens=TOKENS,
            opts=RunOptions(budget=32, prefill_chunk=48, storage=Storage(**storage)),
        )

    plain, whole = chunked(), chunked(rank=16, rank_append=append)
    assert plain.decisions.equals(whole.decisions)
    assert torch.allclose(whole.tensors["steps/nll"], plain.tensors["steps/nll"], atol=1e-4)


def test_xkv_follows_a_chunked_prefill_that_keeps_the_same_tokens_everywhere(tiny):
    """streaming_llm frees the same slots in every head; each chunk's tokens then join at full width."""

    def chunked(**storage):
        return perplexity(
            tiny,
            TEXT,
            "streaming_llm",
            prefill=PREFILL,
            tokens=TOKENS,
            opts=RunOptions(budget=32, prefill_chunk=48, storage=Storage(**storage)),
        )

    plain, whole = chunked(), chunked(rank=96, rank_layers=3, rank_append="full")
    assert torch.allclose(whole.tensors["steps/nll"], plain.tensors["steps/nll"], atol=1e-4)


def test_shared_coefficients_refuse_to_move_into_a_new_layout_in_one_sentence():
    parts = seal_cross_layer(4, [keys_like(10, seed) for seed in range(2)], torch.ones(10, dtype=torch.bool))
    fresh = parts[0].empty(3, 10)
    with pytest.raises(KvlensError, match="cannot follow a layer's slots into a new layout"):
        fresh.take(
            slice(0, 3),
            parts[0],
            slice(0, 3),
            torch.arange(10).expand(3, 10),
            torch.zeros(3, 10, 16),
            torch.ones(3, 10, dtype=torch.bool),
        )
