"""Score patched caches teacher-forced in batches, and greedily search for the smallest sufficient set.

`Scorer.score(masks)` builds the patched caches `batch` at a time (each padded to the longest of its batch)
and scores the built case's answer on each in one batched forward (`score_many`): the answer's
log-probability, and whether the cache reproduces the answer greedily up to its last expected string (then its
greedy answer is that answer's start, so it is right). The recovered share of a patch is `(lp - lp_compressed)
/ (lp_full - lp_compressed)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlens.engine.batch_answer import answer_many, score_many
from kvlens.experiments.bench import ruler
from kvlens.explain.case import Built, answered
from kvlens.explain.groups import Group
from kvlens.explain.patch import patched, without

BATCH = 16  # patched caches per batched forward
TEXT_GAP = 0.1  # text: a set suffices once the gap left is at most this share


@dataclass
class Scores:
    lp: torch.Tensor  # (N,) log-probability of the scored tokens
    right: (
        torch.Tensor
    )  # (N,) bool: reproduces the answer up to its last expected string (False: no such answer)


class Scorer:
    """Scores patched caches of one built case; `lp_full` and `lp_compressed` anchor the recovered shares."""

    def __init__(self, built: Built, batch: int = BATCH):
        self.built, self.batch, self.caches = built, batch, 0
        pair = built.pair
        base = self._score([pair.full, pair.compressed])
        self.lp_full, self.lp_compressed = float(base.lp[0]), float(base.lp[1])

    def _score(self, caches) -> Scores:
        b = self.built
        logp, greedy = score_many(caches, b.ids, b.start, b.scored)
        self.caches += len(caches)
        right = (
            greedy[:, : b.right_upto].all(1) if b.right_upto else torch.zeros(len(caches), dtype=torch.bool)
        )
        return Scores(logp.sum(1), right)

    def score(self, masks: list[torch.Tensor], reverse: bool = False) -> Scores:
        """Restore each mask `(L, Hkv, T)` into the compressed cache (`reverse`: remove only it from the full
        one)."""
        parts = []
        for i in range(0, len(masks), self.batch):
            make = without if reverse else patched
            parts.append(self._score([make(self.built.pair, m) for m in masks[i : i + self.batch]]))
        return Scores(torch.cat([p.lp for p in parts]), torch.cat([p.right for p in parts]))

    def share(self, lp: torch.Tensor) -> torch.Tensor:
        """Recovered share of the log-probability gap, per patched cache."""
        return (lp - self.lp_compressed) / (self.lp_full - self.lp_compressed)

    def sufficient(self, scores: Scores) -> torch.Tensor:
        """Whether each cache fixes the case: its answer is right again (a sample whose full answer is right),
        else the gap left is at most `TEXT_GAP`."""
        if self.built.right_upto:
            return scores.right
        return self.share(scores.lp) >= 1 - TEXT_GAP


def find_minimal(scorer: Scorer, groups: list[Group], shares: list[float]) -> dict:
    """Add `groups` back in order of recovered share (highest first) until the case is fixed; the cumulative
    sets are scored a batch at a time, stopping at the first batch that holds a fix. Returns the groups,
    slots, layers, recovered share and restored entries (`mask`, `(L, Hkv, T)`) of the smallest sufficient
    prefix, its greedy answer (a sample) and its time."""
    t = time.perf_counter()
    order = sorted((i for i, g in enumerate(groups) if g.slots), key=lambda i: -shares[i])
    union = torch.zeros_like(scorer.built.pair.removed)
    sets = []
    for i in order:
        union = union | groups[i].mask
        sets.append(union)
    found, share = None, None
    for start in range(0, len(sets), scorer.batch):
        scores = scorer.score(sets[start : start + scorer.batch])
        fixed = torch.nonzero(scorer.sufficient(scores))[:, 0]
        if len(fixed):
            found = start + int(fixed[0])
            share = float(scorer.share(scores.lp)[int(fixed[0])])
            break
    if found is None:
        return {"found": False, "groups": [], "slots": 0, "seconds": time.perf_counter() - t}
    chosen = [groups[i] for i in order[: found + 1]]
    mask = sets[found]
    out = {
        "found": True,
        "groups": [g.name for g in chosen],
        "slots": int(mask.sum()),
        "slots_removed": int(scorer.built.pair.removed.sum()),
        "recovered_share": share,
        "layers": torch.nonzero(mask.any(-1).any(-1))[:, 0].tolist(),
        "mask": mask,
    }
    b = scorer.built
    if b.case.sample is not None:
        decode = b.case.model.tokenizer.decode
        ((tokens, _),) = answer_many(
            [patched(b.pair, mask)], b.case.question, b.start, b.case.max_new_tokens, done=answered(b.case)
        )
        out["answer"] = decode(tokens, skip_special_tokens=True)
        out["right"] = ruler.score(out["answer"], b.case.sample.answers[0]) == 1
    out["seconds"] = time.perf_counter() - t
    return out
