"""The rank of low-rank storage (`kvlens.kvcache.lowrank`): a slot's coefficient bytes, the largest rank
whose bytes fit a share of the full cache's (`Storage.rank_share`), and a rank's basis (`top_vectors`)."""

from __future__ import annotations

import torch

from kvlens.kvcache.quantize import Storage


def coefficient_bytes(rank: int, elem: int, bits: int | None, group: int) -> int:
    """Bytes of one slot's rank-`rank` coefficients: in the model's dtype (`elem` bytes), or packed codes plus
    a float16 zero point and scale per group of `group` coefficients."""
    if bits is None:
        return rank * elem
    return rank * bits // 8 + 4 * -(-rank // min(group, rank))


def coefficient_slots(append: str, slots: int, sealed: int) -> int:
    """Of a row's `slots`, those that hold coefficients: every one when later tokens are projected (append
    "project"), the `sealed` ones when they are held at full width ("full")."""
    return slots if append == "project" else sealed


def fits(rank: int, bits: int | None, group: int) -> bool:
    """Whether quantized coefficients of `rank` pack into bytes and tile into groups (always, unquantized)."""
    return bits is None or (rank % (8 // bits) == 0 and (rank <= group or rank % group == 0))


def fit_rank(storage: Storage, dim: int, members: int, slots: int, sealed: int, elem: int) -> int:
    """The rank of `storage` for `members` rows of `dim` channels that share coefficients (1: per head), each
    row ending with `slots` slots of which `sealed` hold coefficients (append "full": the rest are full
    width): the given `--kv-rank`, or the largest rank whose bytes (coefficients, bases, full-width tokens)
    are at most `rank_share` of the same slots in the model's dtype (at least the smallest rank that packs).
    """
    if storage.rank is not None:
        return storage.rank
    if storage.rank_share is None:
        raise ValueError("kvlens: low-rank storage needs a rank or a byte share")
    coef_slots = coefficient_slots(storage.rank_append, slots, sealed)
    budget = storage.rank_share * members * slots * dim * elem - members * (slots - coef_slots) * dim * elem
    ranks = [r for r in range(1, members * dim + 1) if fits(r, storage.bits, storage.group)]
    cost = {
        r: coef_slots * coefficient_bytes(r, elem, storage.bits, storage.group) + members * dim * r * elem
        for r in ranks
    }
    return max((r for r in ranks if cost[r] <= budget), default=ranks[0])


def top_vectors(x: torch.Tensor, rank: int) -> torch.Tensor:
    """`(R, D, rank)`: the top `rank` right singular vectors of each `x` `(R, n, D)` (zero columns past n)."""
    _, _, vh = torch.linalg.svd(x.float(), full_matrices=False)  # (R, min(n, D), D)
    basis = vh[:, :rank].transpose(1, 2)
    return torch.nn.functional.pad(basis, (0, rank - basis.shape[2]))
