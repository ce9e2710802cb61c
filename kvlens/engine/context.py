"""Per-run context handed through the model call to the attention function.

Everything a run accumulates lives here or in its `KVCache`, never in module globals or on
`nn.Module`s, so two runs on one shared model cannot see each other's tensors.
Observers (recorder, perturbation meter) are named capture points in the TransformerLens sense:
they see the attention of every layer and are dropped with the context when the run ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch

from kvlens.engine.attention import (
    attention_probs,
    decode_channels,
    decode_rows,
    decode_segments,
    last_rows,
    prefill_stats,
    replayed,
    sdpa,
    visible,
)
from kvlens.engine.hidden import HIDDEN
from kvlens.errors import KvlensError
from kvlens.kvcache import AttentionSpec, Prompt, Replay, group_mean
from kvlens.kvcache.cache import KVCache
from kvlens.kvcache.views import SlotRows
from kvlens.policies import Policy, Replays


class Observer:
    """Capture point called by the attention function; override what you need."""

    needs_rows = False  # decode attention rows must be computed (not only SDPA)
    prefill_rows = 0  # last prefill rows wanted
    needs_prefill_stats = False  # the prompt's accumulated attention (`layer.abar`) must be computed

    def on_start(self, policy: Policy) -> None:
        """The run's policy, before its prefill."""

    def on_prefill(self, layer: SlotRows, query, key, value, last_rows) -> None:
        """query `(1, Hq, T, D)`, key/value `(1, Hkv, T, D)` after RoPE, last_rows `(Hq, L, T)` or None."""

    def on_decode(self, layer: SlotRows, query, probs, out, spec: AttentionSpec) -> None:
        """query `(1, Hq, 1, D)`, probs `(Hkv, G, S)` over `layer`'s slots, out `(1, 1, Hq, D)`; `spec`
        is how the layer attends (scaling, soft-capping, sliding window). `layer.abar` and `nobs` take
        this step's attention after the forward (`RunContext.accumulate`), not yet here."""


class RunContext:
    """Routes one run's attention calls: statistics to the cache, rows to policy and observers."""

    def __init__(
        self,
        cache: KVCache,
        policy: Policy,
        observers: Sequence[Observer] = (),
        windowed: bool = False,
        rotary=None,
    ):
        self.cache = cache
        self.windowed = windowed  # some layer slides: its queries see only part of the slots
        self.rotary = (
            rotary  # positions -> (cos, sin) of the model's RoPE (`Prompt.rotary`), None without one
        )
        self.policy = policy
        self._policy_done = (
            False  # the policy compressed the prompt only (`policy_done`): it sees no more steps
        )
        self.observed_by(observers)
        for obs in self.observers:
            obs.on_start(policy)
        self._observed: list[tuple[SlotRows, torch.Tensor, torch.Tensor | None]] = []  # this step's rows
        self._replay: tuple[int, int] | None = None  # the prompt span a replay pass being fed reconstructs
        self._frozen = False  # compressed once for good (the task protocol): no statistics, no policy
        self.wants_hidden = policy.needs().hidden_states  # the attention layers' input (`hidden_in`)

    def observed_by(self, observers: Sequence[Observer]) -> None:
        """Hand the steps to `observers` from now on, and compute what the policy and they read: decode
        attention rows, the prompt's column sums (a chunked pass over T x T, only when someone reads them),
        its last rows."""
        self.observers = list(observers)
        needs = self.policy.needs()
        policy_rows = needs.decode_rows and not self._policy_done
        self.needs_rows = policy_rows or any(o.needs_rows for o in self.observers)
        # nobody reads a decode step's attention rows: paged layers are read in place (`KVCache.feeding`)
        self.in_place = not (self.needs_rows or self.windowed)
        self.column_sums = needs.column_sums or any(o.needs_prefill_stats for o in self.observers)
        self.prefill_rows = max([needs.prefill_rows] + [o.prefill_rows for o in self.observers])

    def policy_done(self) -> None:
        """The policy compressed the prompt and decodes with no further compression (its decode protocol,
        `Needs.decode_steps` false): decode steps compute attention rows only for observers that read them,
        and the policy is told nothing more."""
        self._policy_done = True
        self.observed_by(self.observers)
        if not self.needs_rows:  # no decode step will set them: the prompt's last rows are not a step's
            for layer in self.cache.layers:
                layer.last_attn = None

    def hidden_in(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The state `(1, q, d_model)` entering layer `layer_idx`'s attention in this forward
        (`kvlens.engine.hidden.tap`), into the layer's run state for the policy, unless it sees no more
        steps (frozen, or done with the prompt)."""
        if not (self._frozen or self._policy_done):
            self.cache.books[layer_idx].state[HIDDEN] = hidden[0]

    @property
    def frozen(self) -> bool:
        """Compressed once for good (`freeze`): attention only, no statistics, no policy, chunks allowed."""
        return self._frozen

    def freeze(self) -> None:
        """No compression after this: later tokens attend to the kept slots and nobody is told (the task
        protocol's compress-once)."""
        self._frozen = True

    @contextlib.contextmanager
    def replaying(self, start: int, end: int) -> Iterator[None]:
        """A replay pass fed inside: it reconstructs the prompt's positions start..end - 1
        (`Replays.replay_passes`), the policy reads its attention (`observe_replay`) and the cache keeps
        nothing of it."""
        self._replay = (start, end)
        try:
            with self.cache.replaying():
                yield
        finally:
            self._replay = None

    def attend(self, layer_idx: int, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """One layer's attention in this run, by what is fed: a replay pass, the prompt (or a chunk of it), or
        a decode step's token; a sliding window hides the slots outside it (see `attention`)."""
        layer = self.cache.layers[layer_idx]
        if self._replay is not None:
            return self._replayed(layer, query, key, value, spec)
        if query.shape[2] > 1:
            return self._prefill(layer, query, key, value, spec)
        return self._decode(layer, query, key, value, spec)

    def _decode(self, layer: SlotRows, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """A decode step's attention: a paged store's segments read where they lie (`update` handed
        nothing), or channel-pruned keys on their kept channels (`update` handed the values only); else, when
        nobody reads the rows (compressed for good, or no reader), SDPA over a layer whose every slot holds a
        token, or the masked rows; else the rows, handed to the statistics, the policy and the observers."""
        pages = self.cache.reads_pages(layer)
        if pages is not None:
            return decode_segments(query, pages, layer.rows, layer.valid.sum(-1).tolist(), spec)
        channels = self.cache.reads_channels(layer)
        if channels is not None:
            return decode_channels(
                query, channels, layer.rows, value, layer.valid if layer.padded else None, spec
            )
        seen = self._in_window(
            layer, spec, layer.valid if layer.padded else None
        )  # None: every slot is a token
        if self.frozen or not self.needs_rows:
            if seen is None and spec.plain:
                return sdpa(query, key, value, spec.scaling)
            return decode_rows(query, key, value, seen, spec)[0]
        out, probs = decode_rows(query, key, value, seen, spec)
        if self.column_sums:  # someone reads `abar` and `nobs`: this step's attention adds to them
            self._observed.append((layer, probs, seen))
        layer.last_attn = probs.reshape(-1, probs.shape[-1])
        if not self._policy_done:
            self.policy.observe(layer, probs)
        for obs in self.observers:
            obs.on_decode(layer, query, probs, out, spec)
        return out

    def _in_window(
        self, layer: SlotRows, spec: AttentionSpec, seen: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`seen` `(Hkv, S)` (None: every slot), or with a sliding window the valid slots inside it."""
        if spec.window is None:
            return seen
        return layer.valid & (self.cache.positions[-1] - layer.pos < spec.window)

    def accumulate(self) -> None:
        """After a decode step's forward, before compression: add its attention to every slot's `abar`
        and its query to `nobs` (when someone reads them: `column_sums`); once for all layers when they share
        one store and no layer slides."""
        observed, self._observed = self._observed, []
        if observed and not self.windowed and (everywhere := self.cache.all_layers()) is not None:
            probs = torch.stack([p for _, p, _ in observed])  # (L, Hkv, G, S)
            everywhere.abar.add_(group_mean(probs.flatten(0, 1)))
            everywhere.nobs.add_(1)
            return
        for layer, probs, seen in observed:
            layer.abar += group_mean(probs)
            layer.nobs += 1 if seen is None else seen

    def _prefill(self, layer: SlotRows, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        t = query.shape[2]
        if key.shape[2] != t:
            return self._extend(layer, query, key, value, spec)
        keep = min(self.prefill_rows, t)
        if self.column_sums or not spec.plain:  # chunked rows: never T x T scores at once
            out, abar, last = prefill_stats(query, key, value, spec, keep)
        else:  # SDPA's output, plus only the last rows a policy reads
            out, abar = sdpa(query, key, value, spec.scaling), None
            last = last_rows(query, key, spec, keep)
        self.observe_prompt(layer, query, key, value, spec, abar, last)
        return out

    def observe_prompt(self, layer: SlotRows, query, key, value, spec: AttentionSpec, abar, last) -> None:
        """The prompt's statistics into the layer and to the policy and observers: abar `(Hkv, T)` or None
        (not computed), last `(Hq, L, T)` the last L attention rows (`kvlens.engine.shared_prefill` calls this
        too)."""
        t = query.shape[2]
        rows = self.needs_rows or self.column_sums
        if abar is not None:
            layer.abar = abar
        if self.column_sums:
            seen_by = t - torch.arange(
                t, device=key.device, dtype=torch.float32
            )  # queries at or after each slot
            layer.nobs = seen_by.clamp(max=spec.window or t).expand(key.shape[1], t).clone()
        if rows:
            layer.last_attn = last[:, -1] if last.shape[1] else None
        self.policy.observe_prefill(
            layer, Prompt(last, query[0], self.cache.positions, spec.scaling, self.rotary)
        )
        for obs in self.observers:
            obs.on_prefill(layer, query, key, value, last if rows else None)

    def _extend(self, layer: SlotRows, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """q tokens fed at once after the prompt's compression: each sees the kept slots and, causally, the
        chunk's own. Either a question appended to a `frozen` cache (no statistics), or the next chunk of a
        chunked prefill (`KVCache.chunked`): its attention adds to every slot's `abar` (column sums) and
        `nobs` (queries that saw it), and its last row is the layer's `last_attn`, as a decode step's would
        (observers see none of it)."""
        chunk = self.cache.chunked and not self.frozen
        if not (self.frozen or chunk):
            raise RuntimeError(
                "kvlens feeds several tokens at once after the prompt only to a frozen cache or in "
                "a chunked prefill."
            )
        hq, q, d = query.shape[1:]
        hkv = key.shape[1]
        allowed = (
            visible(self.cache.positions, layer.pos, spec.window) & layer.valid[:, None, :]
        )  # (Hkv, q, S)
        probs = attention_probs(query[0].view(hkv, hq // hkv, q, d), key[0], spec, allowed[:, None])
        out = torch.matmul(probs.to(value.dtype), value[0].unsqueeze(1))  # (Hkv, G, q, D)
        if chunk and self.column_sums:
            layer.abar += group_mean(probs.sum(2))
            layer.nobs += allowed.sum(1)
        if chunk and (self.needs_rows or self.column_sums):
            layer.last_attn = (
                probs[:, :, -1].reshape(hq, -1).clone()
            )  # a view would keep the chunk's probs alive
        return out.reshape(1, hq, q, d).transpose(1, 2).contiguous()

    def _replayed(self, layer: SlotRows, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """A replay pass: its q queries attend to the prompt's slots and causally to its own keys (the last q
        of `key`); the policy reads them (`observe_replay`); the cache keeps nothing of it."""
        if spec.window is not None:
            raise KvlensError(
                f"{self.policy.name}'s replay pass cannot run on sliding-window layers (layer "
                f"{layer.layer}): the pass would not see the whole prompt it reconstructs."
            )
        q = query.shape[2]
        start, end = self._replay
        out, own_lse, span_lse = replayed(query, key, value, spec, (start, end))
        replay = Replay(start, end, query[0], key[0, :, -q:], own_lse, spec.scaling, spec.softcap, span_lse)
        cast(Replays, self.policy).observe_replay(layer, replay)  # the loop replays only for a `Replays`
        return out
