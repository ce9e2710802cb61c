"""The full and the compressed cache of one prompt side by side, and caches patched between them.

Both caches are `Kept` slots per layer: the full cache holds every context position in order, keys and values
`(Hkv, T, D)`; the compressed one `(Hkv, n, D)` with each slot's position and validity `(Hkv, n)`. An entry
(layer, KV head, position) is *removed* when the compressed cache lacks it (evicted) or holds it with another
key or value (a merge target, or quantized storage). `patched(pair, restore)` is the compressed cache with the
full cache's entries `restore` `(L, Hkv, T)` put back: the compressed slot of a restored position leaves, the
full one comes in. Restoring every removed entry gives the full cache's slots (in another order, which
attention ignores); restoring none gives the compressed cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.engine.batch_answer import Kept
from kvlens.kvcache import padded_index


@dataclass
class Pair:
    """The full and the compressed cache of one context of T tokens. `removed` and `merged` are `(L, Hkv, T)`
    bool: every removed entry, and those a merge touched (its sources, from the decision log, and the slots
    whose key or value changed). `links` `(2, M)`: flat indices into `(L, Hkv, T)` of merge sources and their
    targets (restoring a source restores its targets' original keys and values too)."""

    full: Kept
    compressed: Kept
    removed: torch.Tensor
    merged: torch.Tensor
    links: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        layers, heads, positions = self.removed.shape
        return layers, heads, positions


def compare(full: Kept, compressed: Kept, merges: list[tuple[int, int, int, list[int]]]) -> Pair:
    """What compression removed, from the two caches and the step-0 merges `(layer, kv_head, source,
    targets)`."""
    present_rows: list[torch.Tensor] = []
    changed_rows: list[torch.Tensor] = []
    for (kf, vf, _, pf), (kc, vc, ok, pc) in zip(full.layers, compressed.layers, strict=True):
        hkv, t = pf.shape
        if not bool((pf == torch.arange(t, device=pf.device)).all()):
            raise ValueError("the full cache must hold every context position in order")
        where = torch.where(ok, pc, t)  # invalid slots write into a spare column
        seen = torch.zeros(hkv, t + 1, dtype=torch.bool, device=pc.device)
        seen.scatter_(1, where, ok)
        at = pc.clamp(min=0)[..., None].expand(-1, -1, kf.shape[-1])
        differs = ((kc != kf.gather(1, at)) | (vc != vf.gather(1, at))).any(-1) & ok
        moved = torch.zeros_like(seen)
        moved.scatter_(1, torch.where(differs, pc, t), differs)
        present_rows.append(seen[:, :t])
        changed_rows.append(moved[:, :t])
    present, changed = torch.stack(present_rows).cpu(), torch.stack(changed_rows).cpu()
    _, hkv, t = present.shape
    sources, targets = [], []
    for layer, head, source, tos in merges:
        for target in tos:
            sources.append((layer * hkv + head) * t + source)
            targets.append((layer * hkv + head) * t + target)
    links = torch.tensor([sources, targets], dtype=torch.long).view(2, -1)
    merged = changed.clone()
    merged.view(-1)[links[0]] = True
    return Pair(full, compressed, ~present | changed, merged, links)


def close(pair: Pair, restore: torch.Tensor) -> torch.Tensor:
    """`restore` `(L, Hkv, T)` with the targets of every merge source in it added, within the removed
    entries."""
    flat = restore.reshape(-1).clone()
    if pair.links.shape[1]:
        flat = flat.to(torch.uint8).scatter_reduce(
            0, pair.links[1], flat[pair.links[0]].to(torch.uint8), "amax"
        )
    return flat.bool().view(pair.shape) & pair.removed


def patched(pair: Pair, restore: torch.Tensor) -> Kept:
    """The compressed cache with the full cache's entries `restore` `(L, Hkv, T)` bool put back (layers
    without one are the compressed cache's own tensors, not copies)."""
    layers = []
    for i, (full, comp) in enumerate(zip(pair.full.layers, pair.compressed.layers, strict=True)):
        back = restore[i].to(comp[0].device)
        if not bool(back.any()):
            layers.append(comp)
            continue
        (kf, vf, _, pf), (kc, vc, ok, pc) = full, comp
        stays = ok & ~back.gather(1, pc.clamp(min=0))
        index, valid = padded_index(torch.cat([stays, back], 1))
        take = index[..., None].expand(-1, -1, kc.shape[-1])
        layers.append(
            (
                torch.cat([kc, kf], 1).gather(1, take),
                torch.cat([vc, vf], 1).gather(1, take),
                valid,
                torch.cat([pc, pf], 1).gather(1, index),
            )
        )
    return Kept.of(pair.compressed.model, layers)


def without(pair: Pair, group: torch.Tensor) -> Kept:
    """The reverse patch: the full cache with only the (closed) `group`'s removals `(L, Hkv, T)` applied,
    every other removed entry restored."""
    return patched(pair, pair.removed & ~group)
