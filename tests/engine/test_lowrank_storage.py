"""Low-rank KV storage (`kvlens.kvcache.lowrank`): full rank is the uncompressed cache, the reconstruction
error is the discarded singular values' energy (Eckart-Young, against numpy's SVD), bytes are the stored
tensors', it composes with eviction, and a rank that does not fit gets one sentence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens.cli import main
from kvlens.engine.loop import RunOptions
from kvlens.errors import KvlensError
from kvlens.experiments.api import perplexity
from kvlens.kvcache.lowrank import seal_low_rank
from kvlens.kvcache.quantize import Storage
from tests.engine.conftest import TEXT, keys_like


@pytest.mark.parametrize("rank", [1, 4, 9])
def test_the_reconstruction_error_is_the_discarded_singular_values_energy(rank):
    x = keys_like(40)
    valid = torch.ones(3, 40, dtype=torch.bool)
    states = seal_low_rank(rank, x, valid, 48)
    error = ((states.read(slice(0, 3), 40) - x) ** 2).sum((1, 2))
    for row in range(3):
        sigma = np.linalg.svd(x[row].double().numpy(), compute_uv=False)
        assert float(error[row]) == pytest.approx(float((sigma[rank:] ** 2).sum()), rel=1e-4)


def test_invalid_slots_take_no_part_in_the_basis_and_bytes_are_the_stored_tensors():
    x = keys_like(40)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[:, 30:] = False
    junk = x.clone()
    junk[:, 30:] = 1e4  # what free slots hold must not move the basis
    a, b = seal_low_rank(5, x, valid, 48), seal_low_rank(5, junk, valid, 48)
    assert torch.allclose(a.basis.abs(), b.basis.abs(), atol=1e-5)  # singular vectors up to their sign
    assert a.nbytes(3) == (a.coef.numel() + a.basis.numel()) * 4 == 3 * (48 * 5 + 16 * 5) * 4


def test_full_rank_is_the_uncompressed_cache_and_a_lower_rank_stores_fewer_bytes(tiny):
    opts = lambda **s: RunOptions(storage=Storage(**s))  # noqa: E731
    plain = perplexity(tiny, TEXT, "full", prefill=200, tokens=24, opts=opts())
    whole = perplexity(tiny, TEXT, "full", prefill=200, tokens=24, opts=opts(rank=16))  # head_dim 16
    quarter = perplexity(tiny, TEXT, "full", prefill=200, tokens=24, opts=opts(rank_share=0.25))
    assert torch.allclose(whole.tensors["steps/nll"], plain.tensors["steps/nll"], atol=1e-4)
    assert whole.meta.storage == {
        "bits": None,
        "rank": 16,
        "rank_share": None,
        "rank_layers": None,
        "rank_append": "project",
    }
    slots, rank = 223, 3  # the last cache; the largest rank r with r x (223 + 16) <= 0.25 x 223 x 16
    assert (
        plain.metrics["kv_bytes_peak"] == 3 * 2 * 2 * slots * 16 * 4
    )  # layers x KV heads x (K, V) x float32
    assert (
        quarter.metrics["kv_bytes_peak"] == 3 * 2 * 2 * (slots * rank + 16 * rank) * 4
    )  # coefficients, bases


def test_low_rank_storage_composes_with_eviction_and_leaves_the_prompts_decisions_alone(tiny):
    run = lambda **s: perplexity(
        tiny,
        TEXT,
        "h2o",
        prefill=200,
        tokens=24,  # noqa: E731
        opts=RunOptions(budget=64, storage=Storage(**s)),
    )
    plain, ranked = run(), run(rank=4)
    first = lambda r: r.decisions[r.decisions["step"] == 0].reset_index(drop=True)  # noqa: E731
    assert first(plain).equals(first(ranked))  # the policy chose from the prompt at full precision
    assert ranked.metrics["kv_slots_max"] == plain.metrics["kv_slots_max"] == 64
    assert ranked.metrics["kv_bytes_peak"] < plain.metrics["kv_bytes_peak"] / 3


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"rank": 0}, "--kv-rank must be at least 1"),
        ({"rank_share": 0.0}, "--kv-rank-share must be in (0, 1]"),
        ({"rank_share": 1.5}, "--kv-rank-share must be in (0, 1]"),
        ({"rank": 4, "rank_share": 0.5}, "not both"),
    ],
)
def test_a_rank_that_does_not_fit_gets_one_sentence(settings, words):
    with pytest.raises(KvlensError, match=words.replace("(", r"\(").replace("]", r"\]")):
        Storage(**settings)


def test_a_rank_above_the_head_size_is_refused_before_running(tiny):
    with pytest.raises(KvlensError, match=r"--kv-rank 17 is above the model's head size \(16\)"):
        perplexity(tiny, TEXT, "full", prefill=100, tokens=4, opts=RunOptions(storage=Storage(rank=17)))


def test_the_cli_refuses_both_forms_of_the_rank_in_one_sentence(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with pytest.raises(SystemExit) as done:
        main(
            [
                "ppl",
                "--policy",
                "full",
                "--text-file",
                str(text),
                "--prefill",
                "8",
                "--tokens",
                "2",
                "--kv-rank",
                "4",
                "--kv-rank-share",
                "0.5",
            ]
        )
    err = capsys.readouterr().err
    assert (
        done.value.code == 2 and "not allowed with argument --kv-rank" in err and len(err.splitlines()) == 1
    )
