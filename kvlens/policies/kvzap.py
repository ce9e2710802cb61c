"""`kvzap`: a surrogate trained to predict KVzip+ scores from hidden states; prunes in prefill and decoding.

Jégou & Jeblick, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", 2026,
https://arxiv.org/abs/2601.07891 (kvpress's `KVzapPress` inside `DMSPress`). A KV pair's score is its
layer's surrogate, linear or a small MLP, applied to the state its token brings to the layer's attention
(`Needs.hidden_states`, `(q, d_model)` -> `(Hkv, q)` predicted log KVzip+ scores, one matmul per layer per
token, no attention and no replay). The surrogates are trained for the model by `kvlens train-scorer` and
read from a scorer file (`scorer`: a path, or `auto`, the file trained for this model, found by its
fingerprint, `kvlens.engine.scorers`); the repository ships one for the embedded SmolLM2.

Two modes (`mode`):
- `threshold`, kvpress's `DMSPress` protocol (the paper's): a pair whose score is below `threshold` leaves
  as soon as it is older than the `window` newest positions, at the prompt's compression and at every
  decode step; each head keeps as many as pass (the run reports `compression_ratio_*` and, per step and
  head, `steps/kv_slots`). Defaults: kvpress's `sliding_window_size=128` and the `threshold=-4` of its
  README and model cards (the paper sweeps it; the ratio reached depends on the model and its scorer).
- `ratio`: the lowest scores of each head leave until the budget remains, as any scored eviction (kvpress's
  `KVzapPress` alone as a `ScorerPress`, which has no window), so it runs at the leaderboard's ratios.

Decoding (`decoding`): `rolling` (the default) also scores and prunes each generated token, as the paper's
method does (`DMSPress(decoding=True)`); `once` compresses the prompt only (`DMSPress`'s default).
Divergences: kvpress masks pruned pairs out of attention, kvlens frees them; kvlens's surrogates are trained
on the bundled texts with kvlens's KVzip replay (`kvlens.experiments.scorer_training` names how that differs
from kvpress's `kvzap/train.py`), not downloaded. Cross-checked against kvpress 0.5.5's `KVzapPress` alone and
inside `DMSPress`, built around the shipped scorer held in memory (`scripts/crosscheck_kvpress.py`): the same
positions removed per layer and KV head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlens.kvcache import HIDDEN, SCORER, CacheRows, Prompt, Step, padded_slots
from kvlens.policies.base import (
    NO_ATTENTION,
    Needs,
    ScoredEviction,
    free_logged,
    param,
    recent_mask,
    register,
)

SCORE = "kvzap_score"  # per slot (R, S): the surrogate's predicted log KVzip+ score


@register
@dataclass(frozen=True)
class KVzap(ScoredEviction):
    mode: str = param(
        "ratio",
        "ratio: keep each head's `budget` best scores (any scored eviction); threshold: drop every "
        "pair scoring below `threshold` once older than `window` (kvpress DMSPress, the paper).",
        choices=("ratio", "threshold"),
    )
    threshold: float = param(
        -4.0,
        "Threshold mode: the log score below which a pair leaves (kvpress's README and model cards: -4).",
    )
    window: int = param(
        128, "Threshold mode: the newest positions never pruned (kvpress DMSPress: 128).", minimum=0
    )
    decoding: str = param(
        "rolling",
        "During decoding: score and prune each generated token too (rolling, the paper's method), or "
        "compress the prompt only (once, DMSPress's default).",
        choices=("rolling", "once"),
    )
    scorer: str = param(
        "auto",
        "The scorer file (`kvlens train-scorer --out PATH`), or auto: the one trained for this model "
        "(by its fingerprint) in scorers/, $KVLENS_SCORERS or the kvlens cache.",
    )

    name = "kvzap"
    description = (
        "Keep the pairs a learned surrogate of KVzip+ scores highest (threshold mode: above a threshold)."
    )
    paper = "https://arxiv.org/abs/2601.07891"
    kvpress = "KVzapPress"
    kvpress_differs = (
        "kvlens trains the surrogate for the model (`kvlens train-scorer`) where kvpress downloads "
        "NVIDIA's for a few 8B-32B models; threshold mode is DMSPress's protocol, with pruned pairs freed "
        "rather than masked; ratio mode is KVzapPress alone as a ScorerPress."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(
            NO_ATTENTION,
            hidden_states=True,
            model_data=(f"{SCORER}={self.scorer}",),
            decode_steps=self.decoding == "rolling",
            budget_free=self.mode == "threshold",
        )

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        """Score every prompt slot `(Hkv, T)` from the prompt's hidden states `(T, d_model)`."""
        state = rows.state
        rows.extra[SCORE] = state[f"{SCORER}={self.scorer}"](state[HIDDEN])

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        """`(R, S)` the slots' surrogate scores; at a decode step the token it added is scored first, so that
        a wrapper selecting with them (CaM, Ada-KV) sees it scored. Over a wrapper, a token fed while the
        cache is below its budget (no selection that step) keeps score 0."""
        if not step.prompt:
            self._score_newest(rows)
        return rows.extra[SCORE]

    def no_selection(self, rows: CacheRows, step: Step) -> None:
        """Ratio mode within the budget: score a decode step's token (nothing leaves, but its score is needed
        later; over the budget `score` does it). Threshold mode: drop what scores below the threshold outside
        the window."""
        if self.mode == "ratio":
            if not step.prompt:
                self._score_newest(rows)
            return
        drop = rows.valid & ~recent_mask(rows, self.window) & (self.score(rows, step) < self.threshold)
        if bool(drop.any()):
            free_logged(step, rows, padded_slots(drop))  # (R, E), -1 pads heads that drop fewer

    def _score_newest(self, rows: CacheRows) -> None:
        """The slot of each row's newest position takes its layer's surrogate score of the step's state."""
        key = f"{SCORER}={self.scorer}"
        new = rows.state[key](rows.state[HIDDEN][-1:])  # (Hkv, 1)
        newest = rows.pos == rows.pos.max(-1, keepdim=True).values
        rows.extra[SCORE] = torch.where(newest, new, rows.extra[SCORE])
