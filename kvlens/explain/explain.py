"""`explain`: the recovered share of every group of removals, both ways, and the smallest sufficient set."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from kvlens.engine.shared_prefill import SharedPrefill
from kvlens.errors import KvlensError
from kvlens.explain.case import Built, Case, build
from kvlens.explain.groups import make_groups
from kvlens.explain.search import BATCH, Scorer, find_minimal
from kvlens.figures.head_grid import MAX_STRIP


def explain(
    case: Case,
    by: list[str],
    span: int = 32,
    reverse: bool = False,
    minimal_by: str | None = None,
    batch: int = BATCH,
    shared: SharedPrefill | None = None,
) -> dict:
    """The JSON-able result: the case, its answers, the log-probabilities of the full and compressed caches,
    `all_groups` and `no_groups` (each with its `recovered_share`), one entry per group (`recovered_share`,
    slot count, and with `reverse` the share lost when only that group is removed from the full cache), the
    `minimal` set (when `minimal_by` names a grouping) and the cost of each part. `shared`: the context's
    prefill, when the caller already has it."""
    return explain_built(build(case, shared), by, span, reverse, minimal_by, batch)


def _budget(case: Case) -> str:
    """The case's budget in words."""
    return "under its own rule" if case.budget is None else f"at {case.budget} slots"


def explain_built(
    built: Built,
    by: list[str],
    span: int = 32,
    reverse: bool = False,
    minimal_by: str | None = None,
    batch: int = BATCH,
) -> dict:
    """`explain` of a case already built (its caches and answers: a caller may look at them first)."""
    t0 = time.perf_counter() - built.seconds
    case = built.case
    if not bool(built.pair.removed.any()):
        raise KvlensError(
            f"{case.policy.label} removed nothing from this {len(case.context)}-token prompt "
            f"({_budget(case)}); there is nothing to explain."
        )
    groups = make_groups(
        built.pair, by + ([minimal_by] if minimal_by and minimal_by not in by else []), span, case.needles
    )
    t = time.perf_counter()
    scorer = Scorer(built, batch)
    removed = built.pair.removed
    ends = scorer.score([removed, torch.zeros_like(removed)])
    active = [i for i, g in enumerate(groups) if g.slots]
    lp = scorer.score([groups[i].mask for i in active]).lp
    shares = [0.0] * len(groups)  # a group with nothing removed restores the compressed cache itself
    for i, s in zip(active, scorer.share(lp).tolist(), strict=True):
        shares[i] = s
    entries = [{**g.describe(), "recovered_share": s} for g, s in zip(groups, shares, strict=True)]
    score_s = time.perf_counter() - t
    reverse_s = None
    if reverse:
        t = time.perf_counter()
        lost = 1 - scorer.share(scorer.score([groups[i].mask for i in active], reverse=True).lp)
        for i, s in zip(active, lost.tolist(), strict=True):
            entries[i]["removed_share"] = s
        for e in entries:
            e.setdefault("removed_share", 0.0)
        reverse_s = time.perf_counter() - t
    patches = scorer.caches
    out: dict[str, Any] = {
        "case": case.about,
        "context_tokens": len(case.context),
        "budget": case.budget,
        "shape": dict(zip(("layers", "kv_heads", "positions"), removed.shape, strict=True)),
        "span": span,
        "by": by,
        "needles": [list(n) for n in case.needles],
        "answers": built.answers,
        "scored_tokens": built.scored,
        "lp_full": scorer.lp_full,
        "lp_compressed": scorer.lp_compressed,
        "slots_removed": int(removed.sum()),
        "all_groups": {"recovered_share": float(scorer.share(ends.lp[:1])), "slots": int(removed.sum())},
        "no_groups": {"recovered_share": float(scorer.share(ends.lp[1:])), "slots": 0},
        "groups": [e for e, g in zip(entries, groups, strict=True) if g.kind in by],
    }
    decode = case.model.tokenizer.decode
    for e in out["groups"]:
        if "start" in e:
            e["text"] = decode(case.context[e["start"] : e["end"]])
    if minimal_by:
        pick = [i for i, g in enumerate(groups) if g.kind == minimal_by]
        out["minimal"] = {
            "by": minimal_by,
            **find_minimal(scorer, [groups[i] for i in pick], [shares[i] for i in pick]),
        }
        out["strips"] = strips(removed, out["minimal"].pop("mask", torch.zeros_like(removed)))
    out["cost"] = {
        "prepare_s": built.seconds,
        "score_s": score_s,
        "reverse_s": reverse_s,
        "minimal_s": out["minimal"]["seconds"] if minimal_by else None,
        "patched_caches": scorer.caches - 2,
        "caches_before_minimal": patches - 2,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "total_s": time.perf_counter() - t0,
    }
    return out


def strips(removed: torch.Tensor, restored: torch.Tensor) -> dict:
    """Per layer, KV head and block of positions (the Head grid's pooling, at most `MAX_STRIP` blocks): the
    share of the block removed and the share the minimal set restores, `(L, Hkv, blocks)` as lists."""
    tokens = removed.shape[-1]
    block = math.ceil(tokens / MAX_STRIP)
    pad = block * math.ceil(tokens / block) - tokens

    def pooled(mask: torch.Tensor) -> list:
        full = torch.nn.functional.pad(mask.float(), (0, pad))
        return (full.view(*mask.shape[:2], -1, block).sum(-1) / block).tolist()

    return {"block": block, "removed": pooled(removed), "restored": pooled(restored)}
