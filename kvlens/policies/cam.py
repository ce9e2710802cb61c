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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlens.kvcache import CacheRows, Step, group_mean
from kvlens.policies.base import (
    MergesEvicted,
    Needs,
    ScoredEviction,
    Wrapper,
    check,
    log_evictions,
    log_merges,
    param,
    register,
    scored_eviction_names,
)
from kvlens.policies.streaming_llm import StreamingLLM

GENERATOR = "cam_generator"  # per layer: the run's Bernoulli generator
CHUNK_ELEMENTS = (
    1 << 24
)  # rows solved at once in a step-0 merge: their blocks' systems hold at most this many
SOLVE_BLOCK = 256  # evicted slots per block of a step-0 merge's chain solve (at least the longest chain link)
DECODE_ATTN = "cam_decode_attn"  # per slot: attention summed over decode steps only (score="decode")

# settings of each source; every other parameter keeps its default
PRESETS: dict[str, dict[str, Any]] = {
    # Algorithm 1 and Eq. 14-15 as written: Abar, mean over all local tokens, / m, per generation step
    "paper": {
        "score": "accumulated",
        "denominator": "targets_mean",
        "span": 0,
        "targets": "local",
        "divide": "m",
        "prefill": "evict",
    },
    # cam_hf/utils_lm_eval/modify_llama_cam.py:local_cam_mask (QA tables)
    "official-qa": {
        "score": "accumulated",
        "denominator": "max",
        "span": 0,
        "targets": "local",
        "divide": "m",
        "prefill": "merge",
    },
    # generate_task/streaming_llm/kv_cache_cam.py:slicev (perplexity; merge_num = 16)
    "official-ppl": {
        "score": "accumulated",
        "denominator": "targets_mean",
        "span": 16,
        "targets": "local",
        "divide": "m",
        "prefill": "merge",
    },
    # cam_hf/utils_hh/modify_llama_cam.py:local_cam_mask (summarisation; merge_budget = 32)
    "official-summarization": {
        "score": "current",
        "denominator": "window_mean",
        "span": 32,
        "targets": "local",
        "divide": "m",
        "prefill": "evict",
    },
    # kvpress/presses/cam_press.py:CAMPress (merge_budget = 32)
    "kvpress": {
        "score": "decode",
        "denominator": "targets_mean",
        "span": 32,
        "targets": "kept",
        "divide": "found",
        "prefill": "evict",
    },
}


@register
@dataclass(frozen=True)
class CaM(Wrapper, MergesEvicted):
    """Defaults = the `official-qa` preset: the authors' code behind the paper's main results (Table
    1, accuracy on lm-eval QA tasks, `cam_hf/utils_lm_eval`), so what "CaM" means in the numbers
    the paper reports. `kvpress` is reproduced exactly but is a third party's extension (bulk
    eviction, decode-only scores); `paper` reads a text that leaves the score and the prompt open."""

    base: ScoredEviction = param(
        StreamingLLM(),
        "Eviction policy whose evicted values are merged (any scored "
        "eviction policy; set its parameters as base.NAME).",
        choices=scored_eviction_names,
    )
    score: str = param(
        "accumulated",
        "Attention A of Eq. 14: accumulated over every query (prompt included), over "
        "decode steps only (kvpress), or the current step's (official summarisation code).",
        choices=("accumulated", "decode", "current"),
    )
    denominator: str = param(
        "max",
        "Reference of p = A_i / ref: mean over the targets (paper, kvpress), "
        "mean over the local window after i (official summarisation code), or max over the "
        "sinks, i and its window (official QA code).",
        choices=("targets_mean", "window_mean", "max"),
    )
    span: int = param(
        0,
        "m, how many slots of the pool after an evicted one receive its value (0 = the whole pool).",
        minimum=0,
    )
    targets: str = param(
        "local",
        "Pool of merge targets: the base's local window (paper, official code) or every kept slot (kvpress).",
        choices=("local", "kept"),
    )
    divide: str = param(
        "m",
        "Divide the merged value by m (Eq. 15) or by the number of targets found (kvpress).",
        choices=("m", "found"),
    )
    clamp: tuple[float, float] = param((0.0, 1.0), "lo,hi bounds of the merge probability p (Eq. 14).")
    mask: str = param(
        "bernoulli",
        "Merge mask: Bernoulli(p) (the paper), always merge, or never (= the base).",
        choices=("bernoulli", "always", "never"),
    )
    seed: int = param(0, "Seed of the Bernoulli draws (one generator per layer and run).", minimum=0)
    prefill: str = param(
        "merge",
        "The step-0 compression of the prompt: evict without merging, or merge the "
        "evicted slots one at a time in position order.",
        choices=("evict", "merge"),
    )

    name = "cam"
    description = "Merge the values its base eviction policy drops into the following slots (Bernoulli mask)."
    paper = "https://proceedings.mlr.press/v235/zhang24n.html"
    kvpress = "CAMPress"
    kvpress_differs = (
        "The `kvpress` preset reproduces it step for step (cross-checked with every Bernoulli draw "
        "1); the default is the authors' `official-qa` preset."
    )
    merge_rule = "add"  # provenance: targets keep their own value and add w * V_i
    presets: ClassVar[dict[str, dict[str, Any]]] = PRESETS

    def validate(self) -> None:
        lo, hi = self.clamp
        check(0 <= lo <= hi, f"clamp of cam must be two numbers lo <= hi with lo >= 0; got {self.clamp!r}.")

    def needs(self) -> Needs:
        """The base's; merging needs attention rows even when the base does not (mask=never runs exactly like
        the base), and Abar under score=accumulated."""
        base = self.base.needs()
        if self.mask == "never":
            return base
        return dataclasses.replace(
            base,
            decode_rows=True,
            prefill_rows=max(1, base.prefill_rows),
            column_sums=base.column_sums or self.score == "accumulated",
        )

    def observe(self, rows: CacheRows, probs: torch.Tensor) -> None:
        super().observe(rows, probs)
        if self.score == "decode":
            att = group_mean(probs)  # (R, S)
            if DECODE_ATTN in rows.extra:
                rows.extra[DECODE_ATTN].add_(att)  # a view of the store's rows: in place
            else:
                rows.extra[DECODE_ATTN] = att

    def generator(self, state: dict[str, Any], layer: int) -> torch.Generator:
        """A layer's Bernoulli generator for this run (created in its run state on first use)."""
        if GENERATOR not in state:
            state[GENERATOR] = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        generator: torch.Generator = state[GENERATOR]
        return generator

    @property
    def selector(self) -> ScoredEviction:
        """The base: what it evicts is merged."""
        return self.base

    def merge_evicted(self, rows: CacheRows, keep: torch.Tensor, evicted: torch.Tensor, step: Step) -> None:
        """The base's leaving slots `(R, E)` merge into `keep` `(R, B)` (both in position order), unless the
        mask is `never` or the prompt's compression only evicts (`prefill=evict`)."""
        if self._merges(step):
            self._merge(rows, keep, evicted, step)
        else:
            log_evictions(step, rows, rows.pos.gather(1, evicted))

    def attention(self, rows: CacheRows) -> torch.Tensor:
        """`(R, S)` the attention A that p compares, per `score`."""
        if self.score == "accumulated":
            return rows.abar
        if self.score == "decode":
            return rows.extra.get(DECODE_ATTN, torch.zeros_like(rows.abar))
        last = rows.last_attn
        if last is None:
            raise ValueError(
                "kvlens: cam's score=current reads the latest query's attention, not recorded here"
            )
        return last.view(*rows.pos.shape[:1], -1, rows.pos.shape[1]).mean(1)

    def _merge(self, rows: CacheRows, keep: torch.Tensor, evicted: torch.Tensor, step: Step) -> None:
        """Merge the evicted slots one at a time in position order, each carrying what earlier ones sent it,
        in tensor form (no loop over slots); a decode step's one eviction is the case E = 1.

        Per row, the candidates C are the pool (the newest `pool` kept slots) and the evicted slots, in
        position order (both are sorted, so they interleave by a search, not a sort); evicted slot i sends
        `w_i * V_i` to the first `found_i` candidates after it (its window: the first `reach`). Which
        candidates, p and the draws depend only on the scores, so they are computed for every i at once
        (draws in the same generator order as one at a time). An evicted slot receives from the evicted ones
        before it, so their values solve `(I - W_EE) V_E = V0_E` (E x E, unit lower triangular); each kept
        candidate then adds its senders' `w_i V_i`, a range sum over its place (a difference array).
        """
        r, b, n_ev = rows.pos.shape[0], keep.shape[1], evicted.shape[1]
        local, pool, m = self._sizes(b)  # B: the budget
        if n_ev == 1 and self._merges_one(pool):
            return self._merge_one(rows, keep, evicted, step, [rows])
        pool_slots = keep[:, b - pool :]  # (R, P)
        pos_pool, pos_ev = (
            rows.pos.gather(1, pool_slots).contiguous(),
            rows.pos.gather(1, evicted).contiguous(),
        )

        def ar(n: int) -> torch.Tensor:
            return torch.arange(n, device=keep.device)

        c = torch.searchsorted(pos_pool, pos_ev) + ar(
            n_ev
        )  # (R, E) each evicted slot's place in C, ascending
        at_pool = torch.searchsorted(pos_ev, pos_pool) + ar(pool)  # (R, P)
        n_c = pool + n_ev
        members = torch.empty(r, n_c, dtype=keep.dtype, device=keep.device)
        members.scatter_(1, c, evicted).scatter_(1, at_pool, pool_slots)  # (R, C) slots in position order
        reach = {"local": local, "kept": n_c}[self.targets]  # local: the pool itself (n_c = local + n_ev)
        after = n_c - 1 - c
        found, window = after.clamp(max=min(m, reach)), after.clamp(max=reach)
        all_scores = self.attention(rows).float()
        score = all_scores.gather(1, members)  # (R, C)
        p = self._probabilities(score, c, found, window, all_scores.gather(1, keep[:, : b - pool]), reach)
        draw, w = self._draw([rows], p, found, m)  # (R, E)
        self._add_values(rows, evicted, c, at_pool, pool_slots, found, w)
        if step.log is None:
            return
        pos = rows.pos.gather(1, members)  # (R, C)
        k = ar(max(int(found.max()), 1))  # target j of i is candidate c + 1 + j
        places = (c[..., None] + 1 + k).clamp(max=n_c - 1)  # (R, E, K)
        targets = pos.gather(1, places.flatten(1)).view_as(places).masked_fill(k >= found[..., None], -1)
        log_merges(step, rows, pos_ev, targets, w, p, draw)
        log_evictions(step, rows, pos_ev.masked_fill(found > 0, -1))

    def merge_evicted_layers(
        self,
        layers: Sequence[CacheRows],
        everywhere: CacheRows,
        keep: torch.Tensor,
        evicted: torch.Tensor,
        step: Step,
    ) -> None:
        """A decode step's one evicted slot per row merges on every layer's rows at once (`_merge_one`), each
        layer's draws from its own generator and its decisions logged as its own; else layer by layer."""
        one = evicted.shape[1] == 1 and self.score == "accumulated" and not step.prompt
        if one and self._merges(step) and self._merges_one(self._sizes(keep.shape[1])[1]):
            self._merge_one(everywhere, keep, evicted, step, layers)
        else:
            super().merge_evicted_layers(layers, everywhere, keep, evicted, step)

    def _merges(self, step: Step) -> bool:
        """Whether the evicted slots merge at `step`: never with `mask=never`, nor with `prefill=evict` at the
        prompt."""
        return self.mask != "never" and not (step.prompt and self.prefill == "evict")

    def _merges_one(self, pool: int) -> bool:
        """Whether a step's one evicted slot per row merges on the pool alone (`_merge_one`)."""
        return pool > 0 and self.denominator == "max"

    def _merge_one(
        self,
        rows: CacheRows,
        keep: torch.Tensor,
        evicted: torch.Tensor,
        step: Step,
        layers: Sequence[CacheRows],
    ) -> None:
        """`_merge` of a decode step's one evicted slot per row `(R, 1)` under `denominator=max`, on the pool
        `(R, P)` alone: i's place c among the candidates is the count of pool positions before it, its targets
        are the pool slots c .. c + found - 1, and its reference is the max over i, the pool after it and the
        kept slots outside the pool (the window of the `max` reference runs to the end: `window_max`'s
        suffix). The same p, draws and sums as the general path. `rows` are `layers`' rows, stacked (one
        layer, or every layer's at once)."""
        b = keep.shape[1]
        local, pool, m = self._sizes(b)
        pool_slots = keep[:, b - pool :]  # (R, P)
        pos_pool, pos_ev = rows.pos.gather(1, pool_slots), rows.pos.gather(1, evicted)
        c = (pos_pool < pos_ev).sum(-1, keepdim=True)  # (R, 1)
        reach = {"local": local, "kept": pool + 1}[self.targets]
        found = (pool - c).clamp(max=min(m, reach))
        later = torch.arange(pool, device=keep.device) >= c  # (R, P) the pool after i
        all_scores = self.attention(rows).float()
        a_i = all_scores.gather(1, evicted)
        ref = torch.maximum(
            a_i, all_scores.gather(1, pool_slots).masked_fill(~later, float("-inf")).amax(-1, True)
        )
        if b > pool:  # the kept slots outside the pool (the sinks, heavy hitters)
            ref = torch.maximum(ref, all_scores.gather(1, keep[:, : b - pool]).amax(-1, keepdim=True))
        p = (a_i / ref.clamp(min=1e-30)).clamp(self.clamp[0], self.clamp[1])
        p = torch.where(found > 0, p, torch.zeros_like(p))
        draw, w = self._draw(layers, p, found, m)
        # the pool's places among the candidates (i comes before the pool slots after it)
        places = later.long() + torch.arange(pool, device=keep.device)
        self._add_values(rows, evicted, c, places, pool_slots, found, w)
        if step.log is None:
            return
        k = torch.arange(max(int(found.max()), 1), device=keep.device)  # target j of i is pool slot c + j
        targets = pos_pool.gather(1, (c + k).clamp(max=pool - 1)).masked_fill(k >= found, -1)[:, None]
        n = len(layers)
        for layer, *part in zip(
            layers, *(t.chunk(n) for t in (pos_ev, targets, w, p, draw, found)), strict=True
        ):
            source, into, weight, prob, drawn, has = part
            log_merges(step, layer, source, into, weight, prob, drawn)
            log_evictions(step, layer, source.masked_fill(has > 0, -1))

    def _add_values(
        self,
        rows: CacheRows,
        evicted: torch.Tensor,
        c: torch.Tensor,
        at_pool: torch.Tensor,
        pool_slots: torch.Tensor,
        found: torch.Tensor,
        w: torch.Tensor,
    ) -> None:
        """Add to each pool slot's value what its senders send, in place (see `_merge`). Only the evicted
        slots that drew a merge send (w > 0), so the others leave the system first: each row's senders move to
        the front, in position order (with the default preset, about 3 % of the embedded model's evicted
        prompt slots drew a merge). The senders' chains are solved block by block (forward substitution over
        blocks of `SOLVE_BLOCK` slots or more, each a triangular solve; rows in chunks of at most
        `CHUNK_ELEMENTS` system entries), then each candidate's senders are summed as a difference array over
        the candidates (one scatter, one cumulative sum). A decode step (one evicted slot per row) adds its
        one sender to its range directly, and a step where no slot drew a merge changes nothing."""
        if not bool((w > 0).any()):  # no evicted slot drew a merge: no value changes
            return
        values = rows.values[0]  # (R, S, D)
        if c.shape[1] == 1:  # a decode step: the rows whose one evicted slot drew a merge add it to its range
            send = (w[:, 0] > 0).nonzero()[:, 0]
            sent = values[send[:, None], evicted[send]] * w[send, :, None].to(values.dtype)  # (N, 1, D)
            values[send[:, None], pool_slots[send]] += torch.where(
                receives(at_pool[send], c[send], found[send]), sent, 0.0
            )
            return
        heads = torch.arange(c.shape[0], device=c.device)[:, None]
        n_c = c.shape[1] + at_pool.shape[1]  # candidates: the evicted slots and the pool
        # senders first: a slot that sends nothing changes no value that is kept
        senders = w > 0
        n_send = max(int(senders.sum(1).max()), 1)
        first = torch.sort(senders.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :n_send]
        evicted, c, w = evicted.gather(1, first), c.gather(1, first), w.gather(1, first)
        found = found.gather(1, first).masked_fill(w == 0, 0)  # a row's padding (w = 0) sends to no one
        r, n_ev = c.shape
        exact = torch.float64 if n_ev > 1 else values.dtype  # one sender per row: no rounding to accumulate
        sent = values[heads, evicted].to(exact)  # (R, E, D), merged below
        if (
            n_ev > 1
        ):  # chains: evicted j receives from evicted i when c_i < c_j <= c_i + found_i, so j - i <= found_i
            size = max(
                SOLVE_BLOCK, int(found.max())
            )  # a block receives from itself and the block before only
            wx, rows_at_once = w.to(exact), max(1, CHUNK_ELEMENTS // (size * size))
            for r0 in range(0, r, rows_at_once):
                h = slice(r0, r0 + rows_at_once)
                for lo in range(0, n_ev, size):
                    at, before = slice(lo, lo + size), slice(max(0, lo - size), lo)
                    if lo:  # what the solved block before sends into this one
                        into = torch.where(
                            receives(c[h, at], c[h, before], found[h, before]), wx[h, None, before], 0.0
                        )
                        sent[h, at] += into @ sent[h, before]
                    system = torch.where(receives(c[h, at], c[h, at], found[h, at]), -wx[h, None, at], 0.0)
                    sent[h, at] = torch.linalg.solve_triangular(
                        system, sent[h, at], upper=False, unitriangular=True
                    )
        sent *= w[..., None].to(exact)  # what each evicted slot sends to each of its targets
        # candidate x receives from i when c_i < x <= c_i + found_i: +sent at c_i + 1, -sent after the range,
        # summed
        ends = torch.cat([c + 1, c + 1 + found], dim=1)[..., None].expand(-1, -1, sent.shape[-1])
        received = sent.new_zeros(r, n_c + 1, sent.shape[-1])
        received.scatter_add_(1, ends, torch.cat([sent, -sent], dim=1)).cumsum_(1)
        got = received.gather(1, at_pool[..., None].expand(-1, -1, sent.shape[-1]))  # (R, P, D)
        values[heads, pool_slots] += got.to(values.dtype)

    def _probabilities(
        self,
        score: torch.Tensor,
        c: torch.Tensor,
        found: torch.Tensor,
        window: torch.Tensor,
        outside: torch.Tensor,
        reach: int,
    ) -> torch.Tensor:
        """`(R, E)` p = clamp(A_i / A_ref, lo, hi) of every evicted slot at C places `c`, 0 without a target.

        score `(R, C)` over the candidates in position order; outside `(R, O)` the kept slots outside the
        pool (the `max` reference's sinks and heavy hitters)."""
        a_i = score.gather(1, c)
        if self.denominator == "max":
            ref = torch.maximum(
                window_max(score, reach + 1).gather(1, c),
                outside.max(-1, keepdim=True).values
                if outside.shape[1]
                else a_i.new_full((a_i.shape[0], 1), float("-inf")),
            )
        else:
            span = {"targets_mean": found, "window_mean": window}[self.denominator]
            sums = torch.cat([score.new_zeros(score.shape[0], 1), score.double().cumsum(-1)], dim=1)
            ref = ((sums.gather(1, c + 1 + span) - sums.gather(1, c + 1)) / span.clamp(min=1)).float()
        p = (a_i / ref.clamp(min=1e-30)).clamp(self.clamp[0], self.clamp[1])
        return torch.where(found > 0, p, torch.zeros_like(p))

    def _sizes(self, budget: int) -> tuple[int, int, int]:
        """The base's local window, the pool of merge targets and m (how many after i receive)."""
        local = self.base.local_window(budget)
        pool = {"local": local, "kept": budget}[self.targets]
        return local, pool, self.span or pool

    def _draw(
        self, layers: Sequence[CacheRows], p: torch.Tensor, found: torch.Tensor, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The merge mask and each target's weight `(R, E)` (the rows of `layers`, stacked): Bernoulli(p) from
        each layer's generator, drawn step by step (the k-th evicted slot of every row of the layer together),
        or 1 wherever a target exists; divided by m or by the number of targets found."""
        if self.mask == "always":
            draw = (found > 0).float()
        else:
            shape = (p.shape[1], p.shape[0] // len(layers))
            u = torch.cat(
                [torch.rand(shape, generator=self.generator(rows.state, rows.layer)).T for rows in layers]
            )
            draw = (u.to(p.device) < p).float()
        return draw, draw / (found.clamp(min=1).float() if self.divide == "found" else float(max(m, 1)))


def receives(place: torch.Tensor, c: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """`(R, X, E)` whether the candidate at `place` `(R, X)` receives from the evicted slot at `c` `(R, E)`,
    which sends to the `found` `(R, E)` candidates after it."""
    x, ci = place[:, :, None], c[:, None, :]
    return (x > ci) & (x <= ci + found[:, None, :])


def window_max(x: torch.Tensor, length: int) -> torch.Tensor:
    """`(..., n)` -> the max of `x[..., i : i + length]` at each i (fewer at the end): exact, log2(length)
    steps."""
    if length >= x.shape[-1]:  # every window runs to the end (a decode step's one evicted slot): suffix max
        return x.flip(-1).cummax(-1).values.flip(-1)
    out, span = x, 1
    pad = x.new_full((*x.shape[:-1], length), float("-inf"))
    while span * 2 <= length:  # out[i] = max of x[i : i + span]
        out = torch.maximum(out, torch.cat([out, pad], dim=-1)[..., span : span + x.shape[-1]])
        span *= 2
    if span < length:  # two overlapping windows of `span` cover `length`
        out = torch.maximum(
            out, torch.cat([out, pad], dim=-1)[..., length - span : length - span + x.shape[-1]]
        )
    return out
