"""Each cached key's L2 norm, a per-slot statistic kept across decode steps (D2O's Eq. 9, KeyDiff's cosine).

A decode step writes one new key per row; the others are unchanged unless the policy merged into them. So a
policy that needs every kept key's norm at every step keeps them in `rows.extra[name]` `(R, S)` and computes
only the slots written since its last step (`CacheRows.written`) and those it changed: one norm per slot
instead of a pass over the layer's keys. The norms are bitwise a fresh pass's (`norm_of` over the same keys).
"""

from __future__ import annotations

import torch

from kvlens.kvcache import LOSSY, CacheRows


def norm_of(keys: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """`(R, n)` float32 L2 norms of the keys `(R, S, D)` in `slots` `(R, n)` (all of them: None), clamped at
    `F.normalize`'s eps."""
    if slots is not None:
        keys = keys.gather(1, slots[..., None].expand(-1, -1, keys.shape[-1]))
    norms: torch.Tensor = torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    return norms.clamp_min(1e-12)


def cached_key_norms(
    rows: CacheRows, name: str, index: int, changed: torch.Tensor | None = None
) -> torch.Tensor:
    """`(R, S)` the norms of the layer's cached keys at step `index`, a view of its per-slot statistic `name`.
    At the step after the last one it read, only the newly written slots' norms and those of `changed`
    `(R, k)` (keys the policy changed since: D2O's merge targets) are computed; otherwise (the first call, a
    gap, keys stored lossily: a quantized key changes when it is stored) every key's."""
    at = f"{name}_at"
    written = rows.written
    fresh = rows.state.get(at) == index - 1 and not rows.state.get(LOSSY)
    rows.state[at] = index
    if fresh and written is not None:
        due = written if changed is None else torch.cat([written, changed], 1)  # (R, q + k)
        return rows.extra[name].scatter_(1, due, norm_of(rows.keys[0], due))
    rows.extra[name] = norm_of(rows.keys[0])
    return rows.extra[name]
