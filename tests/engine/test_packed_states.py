"""Packed storage's one contract (`kvlens.kvcache.packed.PackedStates`): every variant, as its seal function
makes it, is a subclass implementing each declared method, and behaves as the contract says: a clone is
independent, an empty storage takes another's slots in a new layout with their full-precision entries, freed
slots give those back, and resizing keeps what is stored."""

from __future__ import annotations

import pytest
import torch

from kvlens.kvcache.channels import ChannelStates, seal_channels
from kvlens.kvcache.kivi import QuantizedStates, seal
from kvlens.kvcache.lowrank import LowRankStates, seal_cross_layer, seal_low_rank
from kvlens.kvcache.packed import PackedStates
from kvlens.kvcache.quantize import Storage

R, N, D, CAPACITY = 2, 40, 64, 48
ALL = slice(0, R)
DECLARED = {
    "empty",
    "capacity",
    "resize",
    "nbytes",
    "read",
    "in_window",
    "roundtrip",
    "write",
    "take",
    "forget",
    "append",
}


def states(seed: int = 0) -> torch.Tensor:
    return torch.randn(R, N, D, generator=torch.Generator().manual_seed(seed))


def sealed(kind: str) -> PackedStates:
    """One variant of packed storage over `states()`, its newest slots in full precision where it has any."""
    x, valid = states(), torch.ones(R, N, dtype=torch.bool)
    pos = torch.arange(N).expand(R, N)
    if kind in ("kivi keys", "kivi values"):
        return seal(Storage(bits=8, group=32, residual=32), kind.split()[1], x, pos, valid, CAPACITY)
    if kind == "token":
        return seal(Storage(bits=4, scheme="token", group=32), "keys", x, pos, valid, CAPACITY)
    if kind == "low rank":
        return seal_low_rank(8, x, valid, CAPACITY)
    if kind == "low rank 4-bit":
        return seal_low_rank(8, x, valid, CAPACITY, bits=4, group=8)
    if kind == "low rank full":
        return seal_low_rank(8, x, valid, CAPACITY, append="full")
    if kind == "cross-layer":
        return seal_cross_layer(8, [x, states(1)], valid[0])[1]
    channels = torch.stack([torch.arange(0, D, 4), torch.arange(1, D, 4)])  # (R, 16)
    whole = torch.zeros(R, N, dtype=torch.bool)
    whole[:, -8:] = True
    return seal_channels(channels, x, valid, whole, CAPACITY)


KINDS = ["kivi keys", "kivi values", "token", "low rank", "low rank 4-bit", "low rank full", "cross-layer"]
KINDS.append("channels")
CLASSES = {QuantizedStates: KINDS[:3], LowRankStates: KINDS[3:7], ChannelStates: KINDS[7:]}


def test_the_contract_is_abstract_and_every_variant_implements_all_of_it():
    """The base declares the methods `PackedStore` calls and cannot be made; each variant overrides every one
    of them (a variant missing one could not be sealed)."""
    assert PackedStates.__abstractmethods__ == DECLARED
    with pytest.raises(TypeError, match="abstract"):
        PackedStates()  # type: ignore[abstract]
    for cls, kinds in CLASSES.items():
        assert issubclass(cls, PackedStates) and not cls.__abstractmethods__
        assert all(getattr(cls, name) is not getattr(PackedStates, name) for name in DECLARED), cls
        assert all(type(sealed(kind)) is cls for kind in kinds)


@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_behaves_as_the_contract_says(kind):
    s = sealed(kind)
    valid = torch.ones(R, N + 1, dtype=torch.bool)
    new = torch.randn(R, 1, D, generator=torch.Generator().manual_seed(2))
    s.append(ALL, torch.full((R, 1), N), new, torch.tensor([N]), valid)
    n = N + 1
    before, held = s.read(ALL, n), s.in_window(ALL, n)
    assert before.shape == (R, n, D) and held.shape == (R, n) and held.dtype == torch.bool
    assert held.any() or kind in ("token", "low rank", "low rank 4-bit")
    assert isinstance(s.nbytes(R), int) and 0 < s.nbytes(1) <= s.nbytes(R)

    copy = s.clone()  # independent, but for cross-layer's shared coefficients
    assert type(copy) is type(s) and torch.equal(copy.read(ALL, n), before)
    copy.write(ALL, torch.zeros(R, n, D), valid.clone(), valid)
    assert torch.equal(s.read(ALL, n), before) and not torch.equal(copy.read(ALL, n), before)
    if kind == "cross-layer":
        assert isinstance(s, LowRankStates) and isinstance(copy, LowRankStates) and copy.coef is s.coef

    capacity = s.capacity
    s.resize(CAPACITY + 16)
    assert s.capacity >= capacity and torch.equal(s.read(ALL, n), before)

    if kind != "cross-layer":  # a group's shared coefficients cannot follow one layer's slots
        index = torch.stack([torch.arange(n).flip(0), torch.arange(n).roll(3)])  # a new layout per row
        into = s.empty(R, CAPACITY)
        assert type(into) is type(s) and into.capacity >= CAPACITY and not into.in_window(ALL, n).any()
        into.take(ALL, s, ALL, index, torch.gather(before, 1, index[..., None].expand(-1, -1, D)), valid)
        assert torch.equal(into.in_window(ALL, n), torch.gather(held, 1, index))
        moved = torch.gather(before, 1, index[..., None].expand(-1, -1, D))
        assert torch.allclose(into.read(ALL, n), moved, atol=0.05)  # stored again, in the new layout

    assert torch.equal(s.roundtrip(ALL, before, valid)[held], before[held])
    s.forget(ALL, torch.ones(R, n, dtype=torch.bool))
    assert not s.in_window(ALL, n).any()
