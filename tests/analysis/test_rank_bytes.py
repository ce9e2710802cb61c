"""The Spectra page's price in bytes (`kvlens.analysis.kinds.rank_bytes`) is what low-rank storage really
does: its error at each rank is `LowRankStates`' measured reconstruction error on the same states, and its
bytes share the stored tensors' bytes."""

from __future__ import annotations

import pytest
import torch

from kvlens.analysis.kinds.rank_bytes import rank_error
from kvlens.analysis.states import states
from kvlens.kvcache.lowrank import seal_low_rank
from kvlens.runs.run import load_run
from tests.conftest import CACHED_RUNS


@pytest.fixture(scope="module")
def full_states():
    return load_run(CACHED_RUNS / "full-states")


@pytest.mark.parametrize("kind, code", [("key", "k"), ("value", "v")])
def test_the_error_and_bytes_of_each_rank_are_low_rank_storages_own(full_states, kind, code):
    found = rank_error(full_states, kind)
    layer = found.layers[1]
    x = states(full_states, code, layer)  # (H, T, D) float32
    heads, t, d = x.shape
    valid = torch.ones(heads, t, dtype=torch.bool)
    for r in (1, 8, 32):
        stored = seal_low_rank(r, x, valid, t)
        measured = ((stored.read(slice(0, heads), t) - x) ** 2).sum((1, 2)) / (x**2).sum((1, 2))
        assert torch.allclose(found.error[1, :, r - 1], measured, rtol=2e-3, atol=1e-6)
        assert float(found.bytes_share()[r - 1]) == pytest.approx(stored.nbytes(heads) / (heads * t * d * 4))


def test_errors_fall_to_zero_at_full_rank_and_the_rank_for_an_error_is_the_first_under_it(full_states):
    found = rank_error(full_states, "key")
    assert bool((found.error[..., 1:] <= found.error[..., :-1] + 1e-6).all())  # more rank, less error
    assert float(found.error[..., -1].abs().max()) < 1e-5
    need = found.rank_for(0.01)
    for layer in range(len(found.layers)):
        for head in range(need.shape[1]):
            r = int(need[layer, head])
            assert found.error[layer, head, r - 1] <= 0.01 and (
                r == 1 or found.error[layer, head, r - 2] > 0.01
            )
