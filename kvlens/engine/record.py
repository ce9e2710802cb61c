"""Recorder: what a run captures, by level, through the attention function's capture points.

Levels (each includes the one before):
- `summary`: tokens, per-step metrics, kept slots per layer and KV head, decisions.
- `states`:  + prefill queries/keys/values after RoPE (`prefill/q|k|v/{layer}`) and the prefill
             accumulated attention (`prefill/abar/{layer}`), before any compression.
- `attention`: + every step's attention rows with the positions of their slots
             (`attn/{layer}`, `attn_pos/{layer}`). Runs written before this level was renamed
             call it `full`; `RecordLevel.parse` reads that name too.
A `layers` filter limits states and rows to some layers; tensors are stored as `dtype` (default
float16) on the CPU.
"""

from __future__ import annotations

import torch

from kvlens.engine.context import Observer
from kvlens.levels import RecordLevel


class Recorder(Observer):
    """Collects named CPU tensors for a `Run`."""

    def __init__(
        self,
        level: str = RecordLevel.SUMMARY,
        layers: list[int] | None = None,
        dtype: torch.dtype = torch.float16,
    ):
        self.level = RecordLevel.parse(level)
        self.layers = layers  # None: every layer
        self.dtype = dtype
        self.needs_rows = self.level is RecordLevel.ATTENTION
        self.prefill_rows = int(self.needs_rows)
        self.needs_prefill_stats = self.level is not RecordLevel.SUMMARY  # `prefill/abar/{layer}`
        self.tensors: dict[str, torch.Tensor] = {}
        self._rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def on_prefill(self, layer, query, key, value, last_rows) -> None:
        i = layer.layer
        if self.level is RecordLevel.SUMMARY or not self.wants(i):
            return
        self.tensors[f"prefill/q/{i}"] = self._cpu(query[0])
        self.tensors[f"prefill/k/{i}"] = self._cpu(key[0])
        self.tensors[f"prefill/v/{i}"] = self._cpu(value[0])
        if layer.abar is not None and layer.abar.shape[-1] == key.shape[2]:
            self.tensors[f"prefill/abar/{i}"] = layer.abar.detach().to("cpu", torch.float32, copy=True)
        if self.needs_rows and last_rows is not None and last_rows.shape[1]:
            self._rows.setdefault(i, []).append(
                (last_rows[:, -1].detach().clone(), layer.pos.detach().clone())
            )

    def on_decode(self, layer, query, probs, out, spec) -> None:
        if not self.needs_rows or not self.wants(layer.layer):
            return
        order = layer.position_order()  # saved oldest first, free slots and padding last (-1)
        pos = layer.pos.masked_fill(~layer.valid, -1).gather(1, order)
        rows = probs.gather(2, order[:, None, :].expand_as(probs)).reshape(-1, probs.shape[-1])
        self._rows.setdefault(layer.layer, []).append((rows.detach(), pos.detach()))

    def _cpu(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", self.dtype, copy=True).contiguous()  # the cache reuses its buffers

    def finish(self) -> dict[str, torch.Tensor]:
        """Stack per-step rows: `attn/{layer}` `(steps, Hq, Smax)`, `attn_pos/{layer}` `(steps, Hkv, Smax)`.

        Positions are -1 where a step had fewer slots.
        """
        for i, rows in self._rows.items():
            smax = max(r.shape[-1] for r, _ in rows)
            attn = torch.zeros(len(rows), rows[0][0].shape[0], smax, dtype=self.dtype)
            pos = torch.full((len(rows), rows[0][1].shape[0], smax), -1, dtype=torch.int32)
            for s, (r, p) in enumerate(rows):
                attn[s, :, : r.shape[-1]] = r.to("cpu", self.dtype)
                pos[s, :, : p.shape[-1]] = p.to("cpu", torch.int32)
            self.tensors[f"attn/{i}"] = attn
            self.tensors[f"attn_pos/{i}"] = pos
        self._rows.clear()
        return self.tensors
