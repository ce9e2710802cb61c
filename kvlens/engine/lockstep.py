"""Many runs advanced together: one batched model forward per step for every run's token, each run over its
own cache.

A run's decode generator (`kvlens.engine.loop._decode`) yields a step's event and then feeds that token alone.
`lockstep` drives several such generators instead: each step it collects every live run's token and feeds them
as one batch `(B, 1)`, each at its own position (`forward_many`), and sends each run its row's logits; the run
then compresses its own cache as it would alone. In the batched forward each layer's projections and MLP run
once for the batch, while its attention is each run's own (`_Rows`: the run's cache `update` and its context's
`attend`, so its statistics, its policy's `observe` and its observers see exactly what they see alone). A
run's steps are therefore those of its own run up to the float rounding of batched matrix products (tested in
`tests/bench/test_compare.py`). Runs leave the batch when they end and new ones may join at any step (a fork
resumed). `prefilled` sets runs up on one prompt with a single shared prefill (`SharedPrefill`).

Each run's time of a step is its own attention and compression plus an equal share of the rest of the batched
forward, so `ms_per_token` and `total_s` add up to the wall time of the batch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from kvlens.engine.attention import CONTEXT_KWARG
from kvlens.engine.loop import Fed, StepEvent, _Loop
from kvlens.engine.shared_prefill import SharedPrefill
from kvlens.errors import Cancelled
from kvlens.kvcache import AttentionSpec
from kvlens.runs.run import Run


class _Rows:
    """The run context of a batched forward: row b's attention runs in `loops[b]`'s cache and context;
    `seconds[b]` sums the time it took."""

    def __init__(self, loops: Sequence[_Loop]):
        self.loops = loops
        self.seconds = [0.0] * len(loops)
        self.wants_hidden = any(loop.ctx.wants_hidden for loop in loops)  # `kvlens.engine.hidden.tap`

    def hidden_in(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The attention's input `(B, 1, d_model)`: row b's to `loops[b]`'s context, where it is read."""
        for b, loop in enumerate(self.loops):
            if loop.ctx.wants_hidden:
                loop.ctx.hidden_in(layer_idx, hidden[b : b + 1])

    def attend(self, layer_idx: int, query, key, value, spec: AttentionSpec) -> torch.Tensor:
        """query `(B, Hq, 1, D)`, key/value `(B, Hkv, 1, D)` of the new tokens -> out `(B, 1, Hq, D)`."""
        outs = []
        for b, loop in enumerate(self.loops):
            t = time.perf_counter()
            keys, values = loop.cache.update(key[b : b + 1], value[b : b + 1], layer_idx)
            outs.append(loop.ctx.attend(layer_idx, query[b : b + 1], keys, values, spec))
            self.seconds[b] += time.perf_counter() - t
        return torch.cat(outs)


def forward_many(
    loops: Sequence[_Loop], tokens: list[int], positions: list[int]
) -> tuple[torch.Tensor, list[float]]:
    """One forward of each loop's token at its position through its own cache and context (as `feed` does
    for one); the logits `(B, V)` and each loop's seconds of it (its attention, its share of the rest)."""
    model = loops[0].model
    pos = torch.tensor(positions, device=model.device)
    rows = _Rows(loops)
    t = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for loop, p in zip(loops, pos, strict=True):
            stack.enter_context(loop.cache.feeding(p[None], loop.ctx.in_place))
        out = model.model(
            input_ids=torch.tensor(tokens, device=model.device)[:, None],
            position_ids=pos[:, None],
            use_cache=False,
            logits_to_keep=1,
            **{CONTEXT_KWARG: rows},
        )
    for loop in loops:
        loop.ctx.accumulate()
    shared = (time.perf_counter() - t - sum(rows.seconds)) / len(loops)
    return out.logits[:, -1], [shared + s for s in rows.seconds]


def prefilled(loops: Sequence[_Loop], prompt: list[int]) -> list[tuple[torch.Tensor, float]]:
    """Every loop's prefill of `prompt` from one shared prefill (`SharedPrefill`: what each loop's own would
    leave, its observers' statistics included), then its replay passes and its prompt's compression. Each
    loop's last logits `(V,)` and its milliseconds (an equal share of the shared forward, plus its own)."""
    shared = SharedPrefill(loops[0].model, prompt, [loop.ctx for loop in loops])
    out = []
    for loop in loops:
        t = time.perf_counter()
        with torch.inference_mode():
            logits = shared.restore(loop)
            loop.after_prompt(prompt)
        out.append((logits, shared.ms / len(loops) + (time.perf_counter() - t) * 1000))
    return out


@dataclass(eq=False)
class Row:
    """One run of a lockstep: its loop, its decode generator, where its prompt ends, and its `Run` once
    done."""

    loop: _Loop
    steps: Generator[StepEvent, Fed | None, Run]
    prompt: int
    run: Run | None = None


def lockstep(
    rows: list[Row],
    on_event: Callable[[Row, StepEvent], Sequence[Row]],
    cancel: threading.Event | None = None,
) -> None:
    """Advance `rows` together until each holds its `Run`: each step, every live row (in order) takes its fed
    logits, compresses and yields its next event, which goes to `on_event` before the next row advances (so a
    teacher-forced row may read a token another row chose this step); the rows `on_event` returns join at
    once (their first event follows). Then the tokens of the rows that go on are fed in one batched forward
    (`forward_many`)."""
    pending: list[tuple[Row, Fed | None]] = [(row, None) for row in rows]
    while pending:
        going: list[tuple[Row, StepEvent]] = []
        for row, fed in pending:  # grows while it runs: joining rows advance in this step
            event = row.steps.send(fed)
            with torch.inference_mode():
                pending.extend((new, None) for new in on_event(row, event))
            if event.last:
                _finish(row)
            else:
                going.append((row, event))
        if cancel is not None and cancel.is_set():
            raise Cancelled("The run was stopped before it finished; nothing was saved.")
        if not going:
            return
        with torch.inference_mode():
            logits, seconds = forward_many(
                [row.loop for row, _ in going],
                [e.token for _, e in going],
                [row.prompt + e.step for row, e in going],
            )
        pending = [(row, (logits[k], seconds[k])) for k, (row, _) in enumerate(going)]


def _finish(row: Row) -> None:
    """The row's generator past its last event: its `Run`."""
    try:
        next(row.steps)
    except StopIteration as done:
        row.run = done.value
        return
    raise RuntimeError("kvlens: a run yielded a step after its last one")
