"""`cam`: Cache Merging on top of an eviction policy.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
https://proceedings.mlr.press/v235/zhang24n.html (Algorithm 1, Eq. 14-15). The `base` eviction
policy decides which slots go (its `select()`); CaM drops their keys and, for each evicted slot
i, adds `M * V_i / m` to the values of its merge targets, `M ~ Bernoulli(clamp(A_i / A_ref, lo, hi))`.

The paper and the authors' code (github.com/zyxxmu/cam) disagree on several choices, and NVIDIA
kvpress's `CAMPress` (kvpress/presses/cam_press.py) makes others. Each is a parameter:
- `score`, the attention A: `accumulated` (summed over every query since the slot entered,
  prompt rows included: kvlens's Abar, H2O's statistic that the paper's Eq. 14 cites), `decode`
  (summed over decode steps only: kvpress `CAMPress._running_attn_sum`), `current` (this step's
  attention: `cam_hf/utils_hh/modify_llama_cam.py:local_cam_mask`).
- `denominator`, A_ref: `targets_mean` (mean over the targets: paper Eq. 14,
  `generate_task/streaming_llm/kv_cache_cam.py:slicev`, kvpress), `window_mean` (mean over the
  local window after i: utils_hh `local_cam_mask`), `max` (max over the kept slots outside the
  local window (the sinks), i and its window: `cam_hf/utils_lm_eval/modify_llama_cam.py:local_cam_mask`).
- `span`, m: the first m slots after i of the pool receive the value (0 = the whole pool: with the
  local window, the paper's "all local tokens" and utils_lm_eval's recent window; never more than
  the pool holds after i); `targets`, the pool:
  the base's local window (the paper, the official code) or every kept slot (kvpress).
- `divide`: by m (Eq. 15, the official code even when fewer targets exist) or by the number of
  targets found (kvpress `actual_budget`). They differ when fewer than m slots follow i (TOVA).
- `prefill`: the step-0 compression of the prompt evicts hundreds of slots at once. `evict`
  merges none of them (the paper's Algorithm 1 runs per generation step; utils_hh masks the prompt
  without merging; kvpress's `CAMPress` merges only as many evicted slots as decode steps ran
  since the last compression, none for the prompt). `merge` merges them one at a time in position
  order, as the utils_lm_eval and kv_cache_cam paths do while the prompt streams in: each evicted
  slot's candidates are the pool plus the evicted slots after it (still in the cache when it
  leaves), the later ones carry the merges they received, and with the local pool its window is
  the `local` candidates after it (the base's window as i leaves a stream). A decode step evicts
  one slot, where both rules coincide.
`presets` name the five sources' settings (`--set preset=NAME`; explicit values override).

Divergences kept: kvlens prefills with full attention, so `accumulated` scores of prompt slots
are full-attention column sums, where the official streaming paths sum attention under their
window mask; utils_hh merges the slot one after the one leaving the window (an off-by-one), kvlens
the one leaving; kvpress evicts the same positions in every KV head (mean score over heads), kvlens
lets the base choose per head. Bernoulli draws come from a generator per layer and run, seeded by
`seed` and the layer. `mask="never"` reproduces the base exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.policies.base import (
    Policy,
    ScoredEviction,
    check,
    group_mean,
    log_evictions,
    newest_cut,
    param,
    register,
    scored_eviction_names,
)
from kvlens.policies.streaming_llm import StreamingLLM

GENERATOR = "cam_generator"  # per layer: the run's Bernoulli generator
DECODE_ATTN = "cam_decode_attn"  # per slot: attention summed over decode steps only (score="decode")

# settings of each source; every other parameter keeps its default
PRESETS: dict[str, dict] = {
    # Algorithm 1 and Eq. 14-15 as written: Abar, mean over all local tokens, / m, per generation step
    "paper": {"score": "accumulated", "denominator": "targets_mean", "span": 0, "targets": "local",
              "divide": "m", "prefill": "evict"},
    # cam_hf/utils_lm_eval/modify_llama_cam.py:local_cam_mask (QA tables)
    "official-qa": {"score": "accumulated", "denominator": "max", "span": 0, "targets": "local",
                    "divide": "m", "prefill": "merge"},
    # generate_task/streaming_llm/kv_cache_cam.py:slicev (perplexity; merge_num = 16)
    "official-ppl": {"score": "accumulated", "denominator": "targets_mean", "span": 16, "targets": "local",
                     "divide": "m", "prefill": "merge"},
    # cam_hf/utils_hh/modify_llama_cam.py:local_cam_mask (summarisation; merge_budget = 32)
    "official-summarization": {"score": "current", "denominator": "window_mean", "span": 32, "targets": "local",
                               "divide": "m", "prefill": "evict"},
    # kvpress/presses/cam_press.py:CAMPress (merge_budget = 32)
    "kvpress": {"score": "decode", "denominator": "targets_mean", "span": 32, "targets": "kept",
                "divide": "found", "prefill": "evict"},
}


@register
@dataclass(frozen=True)
class CaM(Policy):
    """Defaults = the `official-qa` preset: the authors' code behind the paper's main results (Table
    1, accuracy on lm-eval QA tasks, `cam_hf/utils_lm_eval`), so what "CaM" means in the numbers
    the paper reports. `kvpress` is reproduced exactly but is a third party's extension (bulk
    eviction, decode-only scores); `paper` reads a text that leaves the score and the prompt open."""

    base: ScoredEviction = param(StreamingLLM(), "Eviction policy whose evicted values are merged (any scored "
                                 "eviction policy; set its parameters as base.NAME).", choices=scored_eviction_names)
    score: str = param("accumulated", "Attention A of Eq. 14: accumulated over every query (prompt included), over "
                       "decode steps only (kvpress), or the current step's (official summarisation code).",
                       choices=("accumulated", "decode", "current"))
    denominator: str = param("max", "Reference of p = A_i / ref: mean over the targets (paper, kvpress), "
                             "mean over the local window after i (official summarisation code), or max over the "
                             "sinks, i and its window (official QA code).",
                             choices=("targets_mean", "window_mean", "max"))
    span: int = param(0, "m, how many slots of the pool after an evicted one receive its value "
                      "(0 = the whole pool).", minimum=0)
    targets: str = param("local", "Pool of merge targets: the base's local window (paper, official code) or every "
                         "kept slot (kvpress).", choices=("local", "kept"))
    divide: str = param("m", "Divide the merged value by m (Eq. 15) or by the number of targets found "
                        "(kvpress).", choices=("m", "found"))
    clamp: tuple = param((0.0, 1.0), "lo,hi bounds of the merge probability p (Eq. 14).")
    mask: str = param("bernoulli", "Merge mask: Bernoulli(p) (the paper), always merge, or never (= the base).",
                      choices=("bernoulli", "always", "never"))
    seed: int = param(0, "Seed of the Bernoulli draws (one generator per layer and run).", minimum=0)
    prefill: str = param("merge", "The step-0 compression of the prompt: evict without merging, or merge the "
                         "evicted slots one at a time in position order.", choices=("evict", "merge"))

    name = "cam"
    description = "Merge the values its base eviction policy drops into the following slots (Bernoulli mask)."
    paper = "https://proceedings.mlr.press/v235/zhang24n.html"
    merges = True
    merge_rule: ClassVar[str] = "add"  # provenance: targets keep their own value and add w * V_i
    presets: ClassVar[dict[str, dict]] = PRESETS

    def validate(self):
        lo, hi = self.clamp
        check(0 <= lo <= hi, f"clamp of cam must be two numbers lo <= hi with lo >= 0; got {self.clamp!r}.")

    @property
    def needs_attention(self) -> bool:
        # merging needs attention even when the base does not; mask=never runs exactly like the base
        return self.mask != "never" or self.base.needs_attention

    @property
    def cross_layer(self) -> bool:
        return self.base.cross_layer

    def prefill_column_sums(self) -> bool:
        # Abar is read by the base, or by the merge probability under score=accumulated
        return self.base.prefill_column_sums() or (self.mask != "never" and self.score == "accumulated")

    def prefill_rows(self) -> int:
        return self.base.prefill_rows() if self.mask == "never" else max(1, self.base.prefill_rows())

    def min_budget(self) -> int:
        return self.base.min_budget()

    def observe_prefill(self, layer, rows):
        self.base.observe_prefill(layer, rows)

    def observe(self, layer, probs):
        self.base.observe(layer, probs)
        if self.score == "decode":
            att = group_mean(probs)  # (Hkv, S)
            layer.extra[DECODE_ATTN] = layer.extra.get(DECODE_ATTN, torch.zeros_like(att)) + att

    def generator(self, layer) -> torch.Generator:
        """The layer's Bernoulli generator for this run (created on first use)."""
        if GENERATOR not in layer.state:
            layer.state[GENERATOR] = torch.Generator().manual_seed(self.seed * 1_000_003 + layer.layer)
        return layer.state[GENERATOR]

    def compress(self, layer, budget, log):
        if budget is None or layer.n_kept <= budget:
            return
        step0 = layer.prefill_rows is not None
        merging = self.mask != "never" and not (step0 and self.prefill == "evict")
        if merging and layer.one_to_evict(budget):
            evicted = self.base.lowest(layer, budget)
            self._merge_one(layer, evicted, budget, log)
            layer.free(evicted)
            return
        keep, evicted = self.base.select(layer, budget)  # (Hkv, B), (Hkv, E) slots, in position order
        if merging:
            self._merge(layer, keep, evicted, budget, log)
        elif log is not None:
            log_evictions(log, layer, torch.gather(layer.pos, 1, evicted))
        layer.free(evicted)

    def attention(self, layer) -> torch.Tensor:
        """`(Hkv, S)` the attention A that p compares, per `score`."""
        if self.score == "accumulated":
            return layer.abar
        if self.score == "decode":
            return layer.extra.get(DECODE_ATTN, torch.zeros_like(layer.abar))
        return layer.last_attn.view(layer.pos.shape[0], -1, layer.n_slots).mean(1)

    def _merge(self, layer, keep, evicted, budget, log):
        """Merge the evicted slots one at a time in position order (the k-th of every head together).

        "After i" and the windows count in position order: the masks below are indexed by rank
        (the slot's place in position order, `perm` maps rank to slot); values are updated in place.
        """
        hkv, s = layer.pos.shape
        b = keep.shape[1]
        local = self.base.local_window(budget)  # the newest `local` kept slots
        pool = local if self.targets == "local" else b  # kept slots that may receive merges
        m = self.span or pool
        reach = local if self.targets == "local" else s  # how many candidates after i its window spans
        perm = layer.position_order()  # (Hkv, S) rank -> slot
        rank_of = torch.empty_like(perm).scatter_(1, perm, torch.arange(s, device=perm.device).expand(hkv, s))
        slots_evicted = evicted
        keep, evicted = rank_of.gather(1, keep), rank_of.gather(1, evicted)  # ranks, ascending
        score = self.attention(layer).float().gather(1, perm)
        pos = layer.pos.gather(1, perm)
        values = layer.values[0]  # (Hkv, S, D), a view of the cache: merged in place
        cand = torch.zeros(hkv, s, dtype=torch.bool, device=keep.device)
        cand.scatter_(1, keep[:, b - pool:], True)
        cand.scatter_(1, evicted, True)  # an evicted slot stays a candidate until its own turn
        outside = torch.zeros_like(cand).scatter_(1, keep[:, :b - pool], True)  # sinks, heavy hitters
        index = torch.arange(s, device=keep.device)
        no_target = torch.zeros_like(evicted, dtype=torch.bool)
        for k in range(evicted.shape[1]):
            e = evicted[:, k : k + 1]  # (Hkv, 1)
            cand.scatter_(1, e, False)
            after = cand & (index[None, :] > e)
            rank = after.long().cumsum(-1)
            window, targets = after & (rank <= reach), after & (rank <= min(m, reach))
            found = targets.sum(-1)  # (Hkv,)
            p = self._probability(score, e, targets, window, outside, found)
            draw = self._draw(layer, p, found)
            w = draw / (found.clamp(min=1).float() if self.divide == "found" else float(max(m, 1)))  # (Hkv,)
            e_slot = slots_evicted[:, k : k + 1, None].expand(-1, -1, values.shape[-1])
            v_e = torch.gather(values, 1, e_slot)  # (Hkv, 1, D)
            receives = torch.zeros_like(targets).scatter_(1, perm, targets)  # targets, by slot
            values += receives[..., None].to(values.dtype) * (w[:, None, None].to(values.dtype) * v_e)
            no_target[:, k] = found == 0
            if log is not None:
                self._log(layer.layer, pos, log, e, targets, w, p, draw)
        if log is not None:
            log_evictions(log, layer, torch.gather(pos, 1, evicted).masked_fill(~no_target, -1))

    def _merge_one(self, layer, e, budget, log):
        """`_merge` for one evicted slot per head `e` `(Hkv, 1)`, in slot space without sorting.

        The pool is the newest `pool` kept slots; what follows i in it is both the window (it
        spans the whole pool) and, up to the first m by position, the targets.
        """
        local = self.base.local_window(budget)
        pool = local if self.targets == "local" else budget
        m = self.span or pool
        pos, valid = layer.pos, layer.valid
        kept = valid.scatter(1, e, False)
        in_pool = kept & (pos >= newest_cut(pos, kept, pool)) if pool > 0 else torch.zeros_like(kept)
        window = in_pool & (pos > pos.gather(1, e))  # (Hkv, S): the pool after i
        targets = window
        if m < pool:  # only the first m after i
            mth = pos.masked_fill(~window, torch.iinfo(pos.dtype).max).topk(m, dim=-1, largest=False).values[:, -1:]
            targets = window & (pos <= mth)
        found = targets.sum(-1)
        score = self.attention(layer).float()
        p = self._probability(score, e, targets, window, kept & ~in_pool, found)
        draw = self._draw(layer, p, found)
        w = draw / (found.clamp(min=1).float() if self.divide == "found" else float(max(m, 1)))  # (Hkv,)
        values = layer.values[0]  # (Hkv, S, D), merged in place
        v_e = torch.gather(values, 1, e[..., None].expand(-1, -1, values.shape[-1]))  # (Hkv, 1, D)
        values += targets[..., None].to(values.dtype) * (w[:, None, None].to(values.dtype) * v_e)
        if log is None:
            return
        heads, slots = targets.nonzero(as_tuple=True)  # one transfer for every head's targets
        rows: dict[int, list[int]] = {}
        for h, t in zip(heads.tolist(), pos[heads, slots].tolist(), strict=True):
            rows.setdefault(h, []).append(t)
        source, probs, draws, weights = pos.gather(1, e)[:, 0].tolist(), p.tolist(), draw.tolist(), w.tolist()
        parts = layer.parts()  # a `LayerStack`'s rows are its layers' heads, layer by layer
        hkv = len(source) // len(parts)
        for h in sorted(rows):
            log.merge(parts[h // hkv].layer, h % hkv, source[h], sorted(rows[h]), [weights[h]] * len(rows[h]),
                      prob=probs[h], draw=int(draws[h]))
        missed = found == 0
        log_evictions(log, layer, pos.gather(1, e).masked_fill(~missed[:, None], -1))

    def _draw(self, layer, p, found) -> torch.Tensor:
        """`(Hkv,)` the merge mask: Bernoulli(p) from each layer's generator, or 1 wherever a target exists."""
        if self.mask == "always":
            return (found > 0).float()
        u = torch.cat([torch.rand(part.pos.shape[0], generator=self.generator(part)) for part in layer.parts()])
        return (u.to(p.device) < p).float()

    def _probability(self, score, e, targets, window, outside, found) -> torch.Tensor:
        """`(Hkv,)` p = clamp(A_i / A_ref, lo, hi), 0 where no target follows i."""
        a_i = torch.gather(score, 1, e)[:, 0]
        if self.denominator == "targets_mean":
            ref = (score * targets).sum(-1) / found.clamp(min=1)
        elif self.denominator == "window_mean":
            ref = (score * window).sum(-1) / window.sum(-1).clamp(min=1)
        else:
            pool = outside | window
            pool.scatter_(1, e, True)
            ref = score.masked_fill(~pool, float("-inf")).max(-1).values
        p = (a_i / ref.clamp(min=1e-30)).clamp(self.clamp[0], self.clamp[1])
        return torch.where(found > 0, p, torch.zeros_like(p))

    @staticmethod
    def _log(layer, pos, log, e, targets, w, p, draw):
        """One merge row per head that has targets; `pos` `(Hkv, S)` and the masks are in position order."""
        for h in range(e.shape[0]):
            idx = targets[h].nonzero().flatten()
            if len(idx):
                log.merge(layer, h, int(pos[h, e[h, 0]]), pos[h, idx].tolist(),
                          [float(w[h])] * len(idx), prob=float(p[h]), draw=int(draw[h]))
