"""Groups of removals to restore together: by layer, by (layer, KV head), by position span, by decision
kind (evicted or merged), the attention sinks, a task sample's needle, and the needle within each (layer,
KV head)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlens.errors import KvlensError
from kvlens.explain.patch import Pair, close

GROUPINGS = ("layer", "head", "span", "kind", "sinks", "needle", "needle-head")
SINKS = 4  # the first positions, StreamingLLM's attention sinks


@dataclass(frozen=True)
class Group:
    """One group: its grouping (`kind`), its name, the removed entries it restores `(L, Hkv, T)` bool (merge
    targets of its sources included) and where it sits (`layer`, `head`, position span `start..end`)."""

    kind: str
    name: str
    mask: torch.Tensor
    layer: int | None = None
    head: int | None = None
    start: int | None = None
    end: int | None = None

    @property
    def slots(self) -> int:
        return int(self.mask.sum())

    def describe(self) -> dict:
        """JSON-able: kind, name, slots, where it sits, and the layers it touches."""
        out = {
            "kind": self.kind,
            "name": self.name,
            "slots": self.slots,
            "layers": torch.nonzero(self.mask.any(-1).any(-1))[:, 0].tolist(),
        }
        out.update(
            {k: getattr(self, k) for k in ("layer", "head", "start", "end") if getattr(self, k) is not None}
        )
        return out


def parse_by(text: str) -> list[str]:
    """`layer,head,span` -> the groupings, checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in GROUPINGS]
    if bad or not names:
        raise KvlensError(
            f"Unknown grouping '{bad[0] if bad else text}'; the groupings are {', '.join(GROUPINGS)}."
        )
    return names


def check_span(span: int) -> None:
    if span < 1:
        raise KvlensError(f"A position span must be at least 1 token; got {span}.")


def make_groups(
    pair: Pair, by: list[str], span: int = 32, needles: Sequence[tuple[int, int]] = ()
) -> list[Group]:
    """The groups of `by`, in order (the needle's only when `needles`, token spans, are known)."""
    check_span(span)
    removed = pair.removed
    layers, heads, tokens = removed.shape

    def group(kind, name, scope, **where) -> Group:
        return Group(kind, name, close(pair, removed & scope), **where)

    def positions(start: int, end: int) -> torch.Tensor:
        scope = torch.zeros_like(removed)
        scope[:, :, start:end] = True
        return scope

    def cells(layer: int, head: int | None = None) -> torch.Tensor:
        scope = torch.zeros_like(removed)
        scope[layer, slice(None) if head is None else head] = True
        return scope

    out = []
    for kind in by:
        if kind == "layer":
            out += [group(kind, f"L{i}", cells(i), layer=i) for i in range(layers)]
        elif kind == "head":
            out += [
                group(kind, f"L{i}.H{h}", cells(i, h), layer=i, head=h)
                for i in range(layers)
                for h in range(heads)
            ]
        elif kind == "span":
            out += [
                group(
                    kind,
                    f"{s}-{min(s + span, tokens) - 1}",
                    positions(s, s + span),
                    start=s,
                    end=min(s + span, tokens),
                )
                for s in range(0, tokens, span)
            ]
        elif kind == "kind":
            out += [group(kind, "evicted", ~pair.merged), group(kind, "merged", pair.merged)]
        elif kind == "sinks":
            out.append(group(kind, "sinks", positions(0, SINKS), start=0, end=min(SINKS, tokens)))
        elif kind == "needle":
            out += [group(kind, f"needle {s}-{e - 1}", positions(s, e), start=s, end=e) for s, e in needles]
        elif kind == "needle-head" and needles:
            needle = torch.stack([positions(s, e) for s, e in needles]).any(0)
            out += [
                group(kind, f"needle L{i}.H{h}", needle & cells(i, h), layer=i, head=h)
                for i in range(layers)
                for h in range(heads)
            ]
    return out
