"""`CacheRows`: the contract every policy is written against, and what a compression is told (`Step`) and may
read of a prompt (`Prompt`) or of a replay pass (`Replay`).

Shapes: R rows (one layer's KV heads), S slots in use per row (free slots and padding included), D the head
size, Hq query heads, G = Hq / Hkv query heads per KV head.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kvlens.runs.decisions import DecisionLog

# Run-state and model-data names the engine fills (some only for a policy that asks: `Needs.hidden_states`,
# `model_data`)
HIDDEN = "hidden_in"  # per layer: the state entering the attention in the latest forward `(q, d_model)`
O_GRAM = "output_gram"  # per layer: the output projection's per-head Gram matrices `(Hq, D, D)` float32
SCORER = "kvzap_scorer"  # per layer: a trained KVzap surrogate, `(N, d_model)` -> `(Hkv, N)` log scores
# per layer, filled for every policy: True once keys and values are stored lossily (quantized, low rank or
# channel-pruned), so that what is read back is not what was written
LOSSY = "stored_lossy"


class Phase(enum.Enum):
    """Which compression a policy performs: the prompt's (step 0), or a decode step's."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Step:
    """One compression: `index` (0 = after the prompt, t = after the forward that produced token t), `phase`,
    the `budget` (slots per KV head; None for budget-free policies) and the run's decision log (None: off)."""

    index: int
    phase: Phase
    budget: int | None
    log: DecisionLog | None = None

    @property
    def prompt(self) -> bool:
        return self.phase is Phase.PREFILL


@dataclass(frozen=True)
class Prompt:
    """What a policy may read of one layer's prompt while it is prefilled (`Policy.observe_prefill`), besides
    the rows' own statistics (`abar`, `nobs`, `last_attn`)."""

    last: torch.Tensor  # (Hq, L, T) attention rows of the last L queries (L: the most any reader asked for)
    queries: torch.Tensor | None = None  # (Hq, T, D) the prompt's queries after RoPE
    positions: torch.Tensor | None = None  # (T,) their positions
    scaling: float = 1.0  # the layer's logit scale
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = (
        None  # positions -> (cos, sin)
    )


@dataclass(frozen=True)
class Replay:
    """One replay pass of one layer (`Replays.replay_passes`, KVzip's reconstruction): tokens fed after the
    prompt, before its compression, whose keys are never cached; what `Replays.observe_replay` may read beside
    the rows."""

    start: int  # the prompt's positions start..end - 1 are what this pass reconstructs
    end: int
    queries: torch.Tensor  # (Hq, q, D) the pass's queries after RoPE
    keys: torch.Tensor  # (Hkv, q, D) its own keys after RoPE (causal among themselves)
    own_lse: torch.Tensor  # (Hq, q) float32 each query's logsumexp of its logits over those own keys (causal)
    scaling: float  # the layer's logit scale
    softcap: float | None = None  # its tanh soft-capping
    # (Hq, q) float32 each query's logsumexp over the cached slots start..end - 1, where the engine's
    # attention computed it (a plain layer on the CPU); None elsewhere
    span_lse: torch.Tensor | None = None


@runtime_checkable
class CacheRows(Protocol):
    """What a policy may read and change: one layer's slots, R = Hkv rows (its KV heads) of S slots.

    `state` holds the layer's run state (counters, random generators), so policies stay immutable
    configuration. Tensors are views `[:, :S]` of the rows' buffers; assigning one copies into them. The
    engine may hold several layers' rows in one store and select for all of them at once
    (`kvlens.engine.batching`); a policy never sees that.
    """

    @property
    def layer(self) -> int: ...  # the model layer whose rows these are

    keys: torch.Tensor  # (1, R, S, D) after RoPE
    values: torch.Tensor  # (1, R, S, D)
    pos: torch.Tensor  # (R, S) long, -1 for a free slot
    valid: torch.Tensor  # (R, S) bool
    abar: torch.Tensor  # (R, S) float32, accumulated attention
    nobs: torch.Tensor  # (R, S) float32, queries that observed each slot
    extra: MutableMapping[str, torch.Tensor]  # name -> (R, S, ...) per-slot policy statistics
    last_attn: torch.Tensor | None  # (R * G, S) float32, the latest query's attention (G query heads per row)

    @property
    def state(self) -> dict[str, Any]: ...  # the policy's run state for this layer
    @property
    def n_kept(self) -> int: ...  # valid slots of the fullest row
    @property
    def written(self) -> torch.Tensor | None: ...  # (R, q) the slots the latest append wrote (None: none yet)

    def position_order(self) -> torch.Tensor: ...  # (R, S) slot indices oldest first, free/padding last
    def free(self, index: torch.Tensor) -> None: ...  # evict slots (R, E), -1 pads, or marked (R, S) bool
    def retain(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None: ...  # keep (R, S') only
