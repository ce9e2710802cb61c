"""`cam`: Cache Merging on top of an eviction policy.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
https://proceedings.mlr.press/v235/zhang24n.html (Algorithm 1, Eq. 14-15). The `base` eviction
policy decides which slots go (its `select()`); CaM drops their keys and, for each evicted slot
i, merges its value into the `m` kept local slots that follow it:
`p = clamp(Abar[i] / mean(Abar[targets]), lo, hi)`, `M ~ Bernoulli(p)`, `V_k += M * V_i / m`.

Choices where the paper is silent:
- Local slots: the base's recent window, `base.local_window(budget)` (`streaming_llm`: every
  non-sink slot; `h2o` and `scissorhands`: `recent_ratio` of the budget; `tova` has none, so
  every kept slot). The targets are the first `span` local slots after i (default: all of them,
  the paper's "all local tokens"); an evicted slot with no local slot after it is simply evicted.
- The prompt compressed right after prefill (step 0) evicts hundreds of slots at once.
  `prefill="evict"` (default) evicts at step 0 without merging and merges from the first decode
  step on, as the paper's algorithm runs per generation step; `prefill="merge"` applies Eq. 15
  to every step-0 eviction too.
- The base is any registered scored eviction policy, with its own parameters as `base.NAME`.
- Bernoulli draws come from a generator per layer and run, seeded by `seed` and the layer.
`mask="never"` reproduces the base exactly (same kept slots, values and decisions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.policies.base import Policy, ScoredEviction, check, param, register, scored_eviction_names
from kvlens.policies.streaming_llm import StreamingLLM

GENERATOR = "cam_generator"  # per layer: the run's Bernoulli generator


@register
@dataclass(frozen=True)
class CaM(Policy):
    base: ScoredEviction = param(StreamingLLM(), "Eviction policy whose evicted values are merged (any scored "
                                 "eviction policy; set its parameters as base.NAME).", choices=scored_eviction_names)
    span: int = param(0, "m, the number of local slots after an evicted one that receive its value "
                      "(0 = the whole local window).", minimum=0)
    clamp: tuple = param((0.0, 1.0), "lo,hi bounds of the merge probability p (Eq. 14).")
    mask: str = param("bernoulli", "Merge mask: Bernoulli(p) (the paper), always merge, or never (= the base).",
                      choices=("bernoulli", "always", "never"))
    score: str = param("accumulated", "Attention used for p: accumulated Abar (the paper) or the current step's.",
                       choices=("accumulated", "current"))
    seed: int = param(0, "Seed of the Bernoulli draws (one generator per layer and run).", minimum=0)
    prefill: str = param("evict", "What the step-0 compression of the prompt does: evict without merging, or "
                         "merge like decode steps.", choices=("evict", "merge"))

    name = "cam"
    description = "Merge the values its base eviction policy drops into the following local slots (Bernoulli mask)."
    paper = "https://proceedings.mlr.press/v235/zhang24n.html"
    merges = True
    merge_rule: ClassVar[str] = "add"  # provenance: targets keep their own value and add w * V_i

    def validate(self):
        lo, hi = self.clamp
        check(0 <= lo <= hi, f"clamp of cam must be two numbers lo <= hi with lo >= 0; got {self.clamp!r}.")

    @property
    def needs_attention(self) -> bool:
        # merging needs Abar even when the base does not; mask=never runs exactly like the base
        return self.mask != "never" or self.base.needs_attention

    def prefill_rows(self) -> int:
        return self.base.prefill_rows() if self.mask == "never" else max(1, self.base.prefill_rows())

    def min_budget(self) -> int:
        return self.base.min_budget()

    def observe_prefill(self, layer, rows):
        self.base.observe_prefill(layer, rows)

    def observe(self, layer, probs):
        self.base.observe(layer, probs)

    def generator(self, layer) -> torch.Generator:
        """The layer's Bernoulli generator for this run (created on first use)."""
        if GENERATOR not in layer.state:
            layer.state[GENERATOR] = torch.Generator().manual_seed(self.seed * 1_000_003 + layer.layer)
        return layer.state[GENERATOR]

    def compress(self, layer, budget, log):
        if budget is None or layer.n_slots <= budget:
            return
        step0 = layer.prefill_rows is not None
        keep, evicted = self.base.select(layer, budget)  # (Hkv, B), (Hkv, E)
        merging = self.mask != "never" and not (step0 and self.prefill == "evict")
        if merging:
            self._merge(layer, keep, evicted, budget, log)
        elif log is not None:
            log.evict(layer.layer, torch.gather(layer.pos, 1, evicted))
        layer.keep(keep)

    def _weights(self, layer, keep, evicted, budget):
        """Merge matrix `(Hkv, E, B)`: weight of evicted value e in kept slot b, plus p and M `(Hkv, E)`."""
        local = self.base.local_window(budget)
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
            draw = (torch.rand(p.shape, generator=self.generator(layer)).to(p.device) < p).float()
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
