"""`cam`: Cache Merging on top of an eviction policy.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
https://proceedings.mlr.press/v235/zhang24n.html (Algorithm 1, Eq. 14-15). The `base` eviction
policy decides which slots go (its `select()`); CaM drops their keys and, for each evicted slot
i, merges its value into the `m` kept local slots that follow it:
`p = clamp(Abar[i] / mean(Abar[targets]), lo, hi)`, `M ~ Bernoulli(p)`, `V_k += M * V_i / m`.

Choices where the paper is silent:
- Local slots: the base's recent window (`streaming_llm`: every non-sink slot; `h2o` and
  `scissorhands`: `recent_ratio` of the budget; `tova` has none, so every kept slot). The
  targets are the first `span` local slots after i (default: all of them, the paper's "all local
  tokens"); an evicted slot with no local slot after it is simply evicted.
- The prompt compressed right after prefill (step 0) evicts hundreds of slots at once, and
  adding `V_i / m` for each swamps the targets (measured in docs/notes-merging.md).
  `prefill="evict"` (default) evicts at step 0 without merging and merges from the first decode
  step on, as the paper's algorithm runs per generation step; `prefill="merge"` applies Eq. 15
  to every step-0 eviction too.
- Base parameters are CaM fields with the bases' own names and defaults (`sink`,
  `recent_ratio`, `history`); each base uses the ones it has.
`mask="never"` reproduces the base exactly (same kept slots, values and decisions).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlens.policies.base import Policy, ScoredEviction, check, check_int
from kvlens.policies.h2o import H2O
from kvlens.policies.scissorhands import Scissorhands
from kvlens.policies.streaming_llm import StreamingLLM
from kvlens.policies.tova import TOVA

BASES: dict[str, type[ScoredEviction]] = {c.name: c for c in (StreamingLLM, H2O, Scissorhands, TOVA)}


@dataclass
class CaM(Policy):
    """base: eviction policy whose evictions are merged; span: m targets (0 = whole local window);
    clamp: (lo, hi) of the merge probability; mask: bernoulli (paper), always or never (= base);
    score: accumulated Abar (paper) or current-step attention; seed: Bernoulli generator seed;
    prefill: what step-0 evictions do (evict, or merge like decode steps);
    sink, recent_ratio, history: parameters of the base policies that have them."""

    base: Literal["streaming_llm", "h2o", "scissorhands", "tova"] = "streaming_llm"
    span: int = 0
    clamp: tuple = (0.0, 1.0)
    mask: Literal["bernoulli", "always", "never"] = "bernoulli"
    score: Literal["accumulated", "current"] = "accumulated"
    seed: int = 0
    prefill: Literal["evict", "merge"] = "evict"
    sink: int = 4
    recent_ratio: float = 0.5
    history: int = 64

    name = "cam"
    description = "Merge the values its base eviction policy drops into the following local slots (Bernoulli mask)."
    paper = "https://proceedings.mlr.press/v235/zhang24n.html"
    merge_rule: ClassVar[str] = "add"  # provenance: targets keep their own value and add w * V_i

    def __post_init__(self):
        check(self.base in BASES, f"base must be one of {', '.join(BASES)}; got {self.base!r}.")
        check_int("span", self.span, 0)
        check(isinstance(self.clamp, (tuple, list)) and len(self.clamp) == 2 and 0 <= self.clamp[0] <= self.clamp[1],
              f"clamp must be two numbers lo <= hi with lo >= 0; got {self.clamp!r}.")
        check(self.mask in ("bernoulli", "always", "never"), f"mask must be bernoulli, always or never; got {self.mask!r}.")
        check(self.score in ("accumulated", "current"), f"score must be accumulated or current; got {self.score!r}.")
        check(self.prefill in ("evict", "merge"), f"prefill must be evict or merge; got {self.prefill!r}.")
        check(isinstance(self.seed, int), f"seed must be an integer; got {self.seed!r}.")
        cls = BASES[self.base]
        names = {f.name for f in dataclasses.fields(cls)}
        self._base = cls(**{k: getattr(self, k) for k in names})
        self._gen = torch.Generator().manual_seed(self.seed)
        # merging needs Abar even when the base does not; mask=never runs exactly like the base
        self.needs_attention = self.mask != "never" or self._base.needs_attention

    def prefill_rows(self) -> int:
        return self._base.prefill_rows() if self.mask == "never" else max(1, self._base.prefill_rows())

    def min_budget(self) -> int:
        return self._base.min_budget()

    def observe_prefill(self, layer, rows):
        self._base.observe_prefill(layer, rows)

    def observe(self, layer, probs):
        self._base.observe(layer, probs)

    def local_window(self, budget: int) -> int:
        """Kept slots that count as local (the base's recent window)."""
        if isinstance(self._base, StreamingLLM):
            return budget - self.sink
        if isinstance(self._base, (H2O, Scissorhands)):
            return int(budget * self.recent_ratio)
        return budget

    def compress(self, layer, budget, log):
        if budget is None or layer.n_slots <= budget:
            return
        step0 = layer.prefill_rows is not None
        keep, evicted = self._base.select(layer, budget)  # (Hkv, B), (Hkv, E)
        merging = self.mask != "never" and not (step0 and self.prefill == "evict")
        if merging:
            self._merge(layer, keep, evicted, budget, log)
        elif log is not None:
            log.evict(layer.layer, torch.gather(layer.pos, 1, evicted))
        layer.keep(keep)

    def _weights(self, layer, keep, evicted, budget):
        """Merge matrix `(Hkv, E, B)`: weight of evicted value e in kept slot b, plus p and M `(Hkv, E)`."""
        local = self.local_window(budget)
        b = keep.shape[1]
        m = local if self.span == 0 else min(self.span, local)
        # the first m local kept slots after each evicted slot
        is_local = torch.zeros(b, dtype=torch.bool, device=keep.device)
        is_local[b - local:] = True
        after = keep[:, None, :] > evicted[:, :, None]  # (Hkv, E, B)
        cand = after & is_local[None, None, :]
        rank = cand.long().cumsum(-1)
        targets = cand & (rank <= m)  # (Hkv, E, B)
        n_t = targets.sum(-1)  # (Hkv, E)
        if self.score == "accumulated":
            score = layer.abar
        else:
            score = layer.last_attn.view(layer.pos.shape[0], -1, layer.n_slots).mean(1)
        s_keep = torch.gather(score, 1, keep)  # (Hkv, B)
        s_evict = torch.gather(score, 1, evicted)  # (Hkv, E)
        mean_t = (targets * s_keep[:, None, :]).sum(-1) / n_t.clamp(min=1)
        p = (s_evict / mean_t.clamp(min=1e-30)).clamp(self.clamp[0], self.clamp[1])
        p = torch.where(n_t > 0, p, torch.zeros_like(p))
        if self.mask == "always":
            draw = (n_t > 0).float()
        else:
            draw = (torch.rand(p.shape, generator=self._gen).to(p.device) < p).float()
        w = targets.float() * (draw / n_t.clamp(min=1))[..., None]  # (Hkv, E, B)
        return w, targets, p, draw

    def _merge(self, layer, keep, evicted, budget, log):
        w, targets, p, draw = self._weights(layer, keep, evicted, budget)
        d = layer.values.shape[-1]
        v = layer.values[0]  # (Hkv, S, D)
        v_evict = torch.gather(v, 1, evicted[..., None].expand(-1, -1, d))  # (Hkv, E, D)
        added = torch.einsum("heb,hed->hbd", w.to(v.dtype), v_evict)  # (Hkv, B, D)
        new_v = v.clone()
        new_v.scatter_add_(1, keep[..., None].expand(-1, -1, d), added)
        layer.values = new_v[None]
        if log is not None:
            self._log(layer, keep, evicted, w, targets, p, draw, log)

    def _log(self, layer, keep, evicted, w, targets, p, draw, log):
        pos_keep = torch.gather(layer.pos, 1, keep).tolist()
        pos_evict = torch.gather(layer.pos, 1, evicted)  # (Hkv, E)
        has = targets.any(-1)  # (Hkv, E)
        log.evict(layer.layer, pos_evict.masked_fill(has, -1))  # no local slot after it: plain eviction
        for h, e in has.nonzero().tolist():
            position = int(pos_evict[h, e])
            idx = targets[h, e].nonzero().flatten().tolist()
            log.merge(layer.layer, h, position, [pos_keep[h][i] for i in idx], w[h, e, idx].tolist(),
                      prob=float(p[h, e]), draw=int(draw[h, e]))
