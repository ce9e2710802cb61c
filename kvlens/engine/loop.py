"""Prefill + decode loop over a compressed cache: free generation and teacher forcing.

One prefill pass over the first `prefill` tokens (full attention), then the cache is compressed
to the budget using the prefill's attention statistics (step 0). Each later step feeds one token
at its true position, the policy observes the step's attention and compresses again (step t).
One `StepEvent` per produced token goes to `on_step`, so callers can plot live; setting
`cancel` stops within one step and raises `Cancelled` (nothing is saved).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from kvlens.engine import hidden, qfilters, scorers
from kvlens.engine.architectures import rotary_of
from kvlens.engine.attention import CONTEXT_KWARG
from kvlens.engine.batching import batchable, evict_all_layers
from kvlens.engine.context import Observer, RunContext
from kvlens.engine.models import LoadedModel, synchronize
from kvlens.engine.record import Recorder
from kvlens.errors import Cancelled, KvlensError
from kvlens.kvcache import Phase, Step
from kvlens.kvcache.cache import KVCache
from kvlens.kvcache.quantize import Storage
from kvlens.policies import REGISTRY, Policy, PrunesKeys, Replays, resolve_budget
from kvlens.runs.decisions import DecisionLog
from kvlens.runs.meta import Budget, ModelInfo, PolicyInfo, Record, RunMeta
from kvlens.runs.run import Run


@dataclass
class StepEvent:
    """What happened at one step: the token produced (or scored) and the cache after compression."""

    step: int
    token: int
    text: str
    nll: float  # -log p(token)
    kv_slots: list[int]  # largest kept count over KV heads, per layer
    kv_bytes: int
    ms: float  # wall time of the forward + compression that produced this step's logits
    attention: dict | None = None  # last layer's current row: {"positions": [...], "weights": [...]}
    extra: dict = field(default_factory=dict)  # observers' per-step numbers (e.g. perturbation)
    logits: torch.Tensor | None = None  # (V,) the logits this step's token was chosen or scored from
    fork: Callable[[], Fork] | None = None  # a copy of the run before this step's token (while paused here)
    last: bool = False  # the run's last token: nothing more is fed


Fed = tuple[
    torch.Tensor, float
]  # a step's logits (V,) fed by a batched forward, and this run's seconds of it


@dataclass
class RunOptions:
    """How to run: budget (slots or share of the prompt), sampling, recording."""

    budget: int | float | None = None
    max_new_tokens: int = 64
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_at_eos: bool = True
    record: str = "summary"
    record_layers: list[int] | None = None
    log_decisions: bool = True
    storage: Storage = Storage()  # keys and values in the model's dtype, or quantized (`--kv-bits`)
    prefill_chunk: int | None = None  # feed the prompt this many tokens at a time, compressing after each
    # internal: a decode step may run once on every layer's rows (`batchable`); False: layer by layer
    batch_layers: bool = True


def _check_length(model: LoadedModel, n: int) -> None:
    ctx = model.shape()["context"]
    if ctx and n > ctx:
        raise KvlensError(f"The sequence needs {n} tokens but the model's context window is {ctx}.")


def _choose(logits: torch.Tensor, opts: RunOptions, gen: torch.Generator) -> int:
    """The next token from `logits` `(V,)`: the argmax at temperature 0, else a draw from the softmax at
    `temperature` restricted to the top-p nucleus (transformers' own logits warpers, as `model.generate`)."""
    if opts.temperature <= 0:
        return int(torch.argmax(logits))
    scores = TemperatureLogitsWarper(opts.temperature)(None, logits.float()[None])
    if opts.top_p < 1.0:
        scores = TopPLogitsWarper(opts.top_p)(None, scores)
    return int(torch.multinomial(torch.softmax(scores[0], -1).cpu(), 1, generator=gen))


def feed(model: LoadedModel, cache: KVCache, ctx: RunContext, ids: list[int], start: int) -> torch.Tensor:
    """One forward of `ids` at positions start.. through the run's cache and context; the last token's
    logits."""
    dev = model.device
    positions = torch.arange(start, start + len(ids), device=dev)
    with cache.feeding(positions, ctx.in_place):
        out = model.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **{CONTEXT_KWARG: ctx},
        )
    ctx.accumulate()
    return out.logits[0, -1]


# what `Needs.model_data` may name, `NAME` or `NAME=ARGUMENT`: (model, argument) -> one entry per layer
MODEL_DATA: dict[str, Callable[[LoadedModel, str], Iterable[Any]]] = {
    "qfilters": lambda model, _: qfilters.filters_for(model),
    hidden.O_GRAM: lambda model, _: hidden.output_grams(model),
    scorers.SCORER: scorers.layers_for,
}


class _Loop:
    """State of one run; `run()` drives it through its phases: `prefill` (with `after_prompt`: the replay
    passes and `compress_prompt`), then one `decode_step` per token (its forward and `compress_step`)."""

    def __init__(
        self,
        model: LoadedModel,
        policy: Policy,
        opts: RunOptions,
        observers: Sequence[Observer],
        budget: int | None,
        length: int | None,
        once: bool = False,
    ):
        self.model, self.policy, self.opts = model, policy, opts
        self.budget = budget
        self.length = length  # the most tokens the run feeds (None: not known, inside `model.generate`)
        self.recorder = Recorder(opts.record, opts.record_layers)
        # a chunked prefill: compressed layers hold up to budget + chunk slots
        self.chunk = opts.prefill_chunk
        self.headroom = self.chunk or 1  # slots past the budget: a decode step's token, or a prefill chunk
        self.cache = self._new_cache(once)
        self.log = DecisionLog() if opts.log_decisions else None
        self.ctx = RunContext(
            self.cache,
            policy,
            [self.recorder, *observers],
            windowed=bool(model.supported().sliding),
            rotary=rotary_of(model.model, model.supported()),
        )
        self._load_model_data()
        self.decodes = policy.needs().decode_steps  # compresses at decode steps (its decode protocol)
        self.prompt_length: int | None = None  # set by `after_prompt`
        self.budgets: Sequence[int | None] = [budget] * model.shape()["layers"]  # each layer's (`allocate`)
        self.kept: list[torch.Tensor] = []  # (L, Hkv) per step
        self.peak_bytes = 0  # largest cache after compression
        self.replay_ms, self.replay_passes = 0.0, 0  # the policy's replay passes (KVzip), part of the prefill
        # the largest cache of the prefill, before compression (the whole prompt unchunked)
        self.prefill_bytes = 0
        self.token_bytes = 0.0  # one prompt token's keys and values in the model's dtype, all layers
        self.channels: torch.Tensor | None = None  # (L, Hkv, K) the key channels kept (a policy that prunes)

    def _new_cache(self, once: bool) -> KVCache:
        """The run's cache: a compressed layer never holds more than budget + headroom slots, others grow up
        to the run's length; all layers' rows in one store when a decode step may run once on them
        (`batchable`); `once` (compressed after the prompt only, later tokens appended): a store per layer."""
        opts, policy, needs = self.opts, self.policy, self.policy.needs()
        return KVCache(
            self.model.shape()["layers"],
            limit=self.length if self.budget is None else self.budget + self.headroom,
            all_layers=self.budget is not None and opts.batch_layers and batchable(policy) and not once,
            chunked=bool(self.chunk),
            # a budget-free layer reading attention rows (CORM) stays padded: compaction bounds its padding,
            # and pages would be gathered at every step (120 vs 90 ms per token at 4096 tokens)
            paged=not (
                opts.storage.packed or needs.pruned_keys or (self.budget is None and needs.decode_rows)
            ),
            compacts=self.budget is None and opts.storage.rank_layers is None,  # xKV: layers share one layout
        )

    def _load_model_data(self) -> None:
        """What the policy reads of the model (`Needs.model_data`, e.g. its Q-Filters), one entry per layer in
        the layers' run state; the attention layers' input tapped if it reads hidden states."""
        for name in self.policy.needs().model_data:
            kind, _, argument = name.partition("=")
            for book, part in zip(self.cache.books, MODEL_DATA[kind](self.model, argument), strict=True):
                book.state[name] = part
        if self.policy.needs().hidden_states:
            hidden.tap(self.model.model)

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        return feed(self.model, self.cache, self.ctx, ids, start)

    def freeze(self) -> None:
        """No compression after this: later tokens (one, or a chunk such as a question) attend to the kept
        slots and are appended; the policy sees nothing more (the task protocol's compress-once)."""
        self.ctx.freeze()

    def replay(self, prompt: list[int]) -> None:
        """The policy's replay passes over the prompt's cache (`Replays.replay_passes`), before its
        compression."""
        if not isinstance(self.policy, Replays):
            return
        t = time.perf_counter()
        passes = self.policy.replay_passes(self.model.tokenizer, prompt)
        for start, end, ids in passes:
            with self.ctx.replaying(start, end):
                self.forward(ids, len(prompt))
        synchronize(self.model.device)
        self.replay_passes = len(passes)
        self.replay_ms = (time.perf_counter() - t) * 1000 if passes else 0.0

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Feed the prompt, in chunks of `prefill_chunk` tokens if set, and compress it: after each chunk, all
        of them step 0's compressions (one chunk: exactly the unchunked run). The last token's logits."""
        size = self.chunk or len(prompt)
        logits = self.forward(prompt[:size], 0)
        self.after_prompt(prompt[:size], last=size >= len(prompt), length=len(prompt))
        for start in range(size, len(prompt), size):
            logits = self.forward(prompt[start : start + size], start)
            self.compress_prompt(first=False, last=start + size >= len(prompt))
        return logits

    def after_prompt(self, prompt: list[int], last: bool = True, length: int | None = None) -> None:
        """What follows the forward of the prompt (or of its first chunk): the policy's replay passes, then
        step 0's compression (`last`: no chunk follows; `length`: the whole prompt's, when chunked)."""
        self.token_bytes = self.cache.nbytes / len(prompt)
        self.prompt_length = length or len(prompt)
        self.replay(prompt)
        self.compress_prompt(last=last)

    def compress_prompt(self, first: bool = True, last: bool = True) -> None:
        """Step 0's compression, layer by layer (`first`: after the prompt or its first chunk, `last`: no
        chunk follows). Before it the policy allocates each layer's budget (the same everywhere unless it
        allocates); after it the storage is sealed (`_seal`)."""
        self.prefill_bytes = max(self.prefill_bytes, self.cache.nbytes)
        if self.budget is not None and first:
            self.budgets = self.policy.allocate(self.budget, self.cache.layers)
            self.cache.set_budgets(self.budgets, self.headroom)
        self._compress_layers(0, Phase.PREFILL)
        if first:
            self._seal()
        self._settle(0, last)

    def compress_step(self, index: int) -> None:
        """Decode step `index`'s compression: on every layer's rows at once when they share one store, else
        layer by layer, unless the policy's protocol compresses the prompt only."""
        self._compress_layers(index, Phase.DECODE)
        self._settle(index, True)

    def _compress_layers(self, index: int, phase: Phase) -> None:
        self.cache.commit()
        if phase is Phase.DECODE and (everywhere := self.cache.all_layers()) is not None:
            evict_all_layers(
                self.policy, everywhere, self.cache.layers, Step(index, phase, self.budget, self.log)
            )
        elif phase is Phase.PREFILL or self.decodes:
            for rows, budget in zip(self.cache.layers, self.budgets, strict=True):
                self.policy.compress(rows, Step(index, phase, budget, self.log))
        self.cache.commit()  # quantized storage: what the policy merged is quantized again

    def _seal(self) -> None:
        """The compressed prompt's storage: quantized (the policy chose from it in full precision), and the
        key channels a pruning policy keeps (ThinK)."""
        self.cache.quantize(self.opts.storage)
        if isinstance(self.policy, PrunesKeys):
            plans = [self.policy.key_channels(rows) for rows in self.cache.layers]
            self.cache.prune_keys(plans)
            self.channels = torch.stack([channels for channels, _ in plans]).cpu()

    def _settle(self, index: int, last: bool) -> None:
        """After a compression: the kept counts (`last`: of the whole prompt or of a step); a policy done with
        the prompt stops seeing steps, and the cache reserves room for the tokens to come; the peak bytes."""
        if last:
            self.kept.append(self.cache.kept_counts())
            if index == 0 and not self.decodes:
                self.ctx.policy_done()
                if self.length is not None and self.prompt_length is not None:
                    self.cache.reserve(self.length - self.prompt_length)
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes)

    def decode_step(
        self, token: int, position: int, index: int, fed: Fed | None
    ) -> tuple[torch.Tensor, float]:
        """Decode step `index`: feed `token` at `position` (or take the logits and seconds of a driver's
        batched forward, `fed`), then `compress_step`. The logits `(V,)` and the step's ms (its share of the
        batched forward included)."""
        t = time.perf_counter()
        with torch.inference_mode():
            if fed is None:
                logits, shared = self.forward([token], position), 0.0
            else:
                logits, shared = fed
            self.compress_step(index)
        synchronize(self.model.device)
        return logits, (time.perf_counter() - t + shared) * 1000

    def event(self, step, token, nll, ms, logits, final: bool) -> StepEvent:
        last = self.cache.layers[-1]
        attention = None
        if last.last_attn is not None:
            slots = last.position_order()[0, : int(last.valid[0].sum())]  # head 0's valid slots, oldest first
            attention = {
                "positions": last.pos[0, slots].tolist(),
                "weights": last.last_attn.mean(0)[slots].tolist(),
            }
        kept = self.kept[-1].max(-1).values.tolist()
        return StepEvent(
            step=step,
            token=token,
            text=self.model.tokenizer.decode([token]),
            nll=nll,
            kv_slots=kept,
            kv_bytes=self.cache.nbytes,
            ms=ms,
            attention=attention,
            logits=logits,
            last=final,
        )


def run(
    model: LoadedModel,
    policy: Policy,
    ids: list[int],
    *,
    prefill: int,
    steps: int,
    teacher: bool,
    opts: RunOptions,
    observers: Sequence[Observer] = (),
    on_step: Callable[[StepEvent], None] | None = None,
    cancel: threading.Event | None = None,
    meta: dict | None = None,
) -> Run:
    """Run `policy` over `ids`: prefill the first `prefill`, then produce `steps` tokens.

    teacher=True scores `ids[prefill:prefill+steps]` (teacher forcing); otherwise tokens are
    generated (greedy, or seeded sampling) and `ids` beyond `prefill` are ignored.
    """
    loop = prepare_run(model, policy, ids, prefill, steps, teacher, opts, observers)
    try:
        events = _steps(loop, ids, prefill, steps, teacher, meta)
        return drain(events, on_step, cancel)
    except (MemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        message = str(err).splitlines()[0][:200]
    del loop, events  # free the cache before telling the caller
    raise out_of_memory(prefill, steps, message)


def drain(
    events: Generator[StepEvent, None, Run], on_step=None, cancel: threading.Event | None = None
) -> Run:
    """Drive a run's steps to its `Run`, each event to `on_step`; `Cancelled` once `cancel` is set."""
    while True:
        try:
            event = next(events)
        except StopIteration as done:
            return done.value
        if on_step is not None:
            with torch.inference_mode():
                on_step(event)
        if cancel is not None and cancel.is_set():
            raise Cancelled("The run was stopped before it finished; nothing was saved.")


def out_of_memory(prefill: int, steps: int, message: str) -> KvlensError:
    """The sentence for a run of `prefill` + `steps` tokens that ran out of memory (`message`: the error's
    first line), once the memory is freed: call it outside the `except` block, once nothing holds the runs."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return KvlensError(
        f"Out of memory on {prefill} + {steps} tokens ({message}); the memory was freed: "
        f"try a shorter text, fewer tokens or a smaller model."
    )


def run_steps(
    model: LoadedModel,
    policy: Policy,
    ids: list[int],
    *,
    prefill: int,
    steps: int,
    teacher: bool,
    opts: RunOptions,
    observers: Sequence[Observer] = (),
    meta: dict | None = None,
) -> Generator[StepEvent, None, Run]:
    """`run` one step at a time: yields each `StepEvent` right after its step and returns the `Run`.

    Several runs can be advanced in turn, one step each (the speed benchmark's lockstep), so that
    whatever slows the machine down meanwhile hits all of them alike. `total_s` counts only the
    run's own time, not the time spent suspended between steps.
    """
    loop = prepare_run(model, policy, ids, prefill, steps, teacher, opts, observers)
    return (yield from _steps(loop, ids, prefill, steps, teacher, meta))


def _check_chunk(policy: Policy, opts: RunOptions, observers) -> None:
    """Refuse, in one sentence, a chunked prefill the run cannot do as asked."""
    if opts.prefill_chunk is None or opts.prefill_chunk < 1:
        raise KvlensError("--prefill-chunk must be at least 1 token.")
    if not policy.chunked_prefill:
        names = ", ".join(n for n, cls in REGISTRY.items() if cls.chunked_prefill)
        raise KvlensError(
            f"{policy.name} cannot compress a prompt chunk by chunk (it needs the whole prompt's "
            f"statistics at once); --prefill-chunk works with {names}."
        )
    if opts.record != "summary" or observers:
        raise KvlensError(
            "A chunked prefill records the summary only and cannot --measure: recorders and the "
            "perturbation meter see a prompt in one piece."
        )


def prepare_run(model: LoadedModel, policy: Policy, ids, prefill, steps, teacher, opts, observers) -> _Loop:
    """Check the request and set up the run's state (budget, cache, context)."""
    if prefill < 1:
        raise KvlensError("The prompt is empty: give at least one token.")
    if steps < 1:
        raise KvlensError("Ask for at least one new token.")
    if teacher and len(ids) < prefill + steps:
        raise KvlensError(f"The text has {len(ids)} tokens, fewer than prefill + tokens = {prefill + steps}.")
    _check_length(model, prefill + steps)
    return new_loop(model, policy, opts, observers, prefill, prefill + steps)


def new_loop(
    model: LoadedModel, policy: Policy, opts: RunOptions, observers, prefill: int, total: int | None
) -> _Loop:
    """A run's state over a prompt of `prefill` tokens once the model, the storage and the chunking pass their
    checks, with the budget resolved; `total`: the run's length (None: not known, inside `model.generate`)."""
    model.supported().require()  # never run a model kvlens would only approximate
    opts.storage.check(model.shape()["head_dim"], model.shape()["kv_heads"])
    if policy.needs().pruned_keys and opts.storage.packed:
        raise KvlensError(
            f"{policy.name} stores its keys channel-pruned, which does not combine with quantized or "
            f"low-rank storage (--kv-bits, --kv-rank) yet: choose one of them."
        )
    if opts.prefill_chunk is not None:
        _check_chunk(policy, opts, observers)
        if opts.prefill_chunk >= prefill:  # one chunk: the unchunked run
            opts = dataclasses.replace(opts, prefill_chunk=None)
    budget = resolve_budget(policy, opts.budget, prefill, total)
    length = None if total is None else total - 1  # the last token is never fed
    return _Loop(model, policy, opts, list(observers), budget, length)


def is_oom(err: BaseException) -> bool:
    """Whether `err` says the memory ran out (CPU or CUDA)."""
    return (
        isinstance(err, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in str(err)
        or "out of memory" in str(err).lower()
    )


def _steps(loop: _Loop, ids, prefill, steps, teacher, meta) -> Generator[StepEvent, None, Run]:
    """The prefill, then the decode loop (`_decode`), one yield per produced token (each step in inference
    mode)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = loop.prefill(ids[:prefill])
    synchronize(loop.model.device)
    prefill_ms = (time.perf_counter() - t0) * 1000
    done = _Progress(ids[:prefill], 0, logits, [], [], [], prefill_ms, prefill_ms)
    return (yield from _decode(loop, done, ids, steps, teacher, meta, t0))


@dataclass
class _Progress:
    """Where a run stands before choosing the token of `step`: the logits it chooses from, what it
    produced."""

    prompt: list[int]
    step: int
    logits: torch.Tensor  # (V,)
    tokens: list[int]
    nlls: list[float]
    ms: list[float]  # each decode step's ms so far
    prefill_ms: float
    step_ms: float  # ms of the forward that produced `logits`

    def finished(self, loop: _Loop, total_s: float, teacher: bool, meta: dict | None) -> Run:
        """The run that got here in `total_s` seconds, ended."""
        return _make_run(
            loop,
            loop.model,
            self.prompt,
            self.tokens,
            self.nlls,
            self.ms,
            self.prefill_ms,
            total_s,
            teacher,
            meta,
        )


def _decode(
    loop: _Loop, done: _Progress, ids, steps, teacher, meta, t0: float
) -> Generator[StepEvent, Fed | None, Run]:
    """Choose (or score) a token, yield its event, feed it and compress, from `done.step` to `steps`. A driver
    may send the fed token's logits and this run's seconds of a batched forward (`kvlens.engine.lockstep`);
    then only the compression runs here. `ids` is read at each step (teacher forcing on a text still being
    written: the driver extends it)."""
    gen = torch.Generator().manual_seed(loop.opts.seed)
    prefill, logits, step_ms = len(done.prompt), done.logits, done.step_ms
    suspended = 0.0  # time spent between a yield and the next step
    for i in range(done.step, steps):
        with torch.inference_mode():
            token = ids[prefill + i] if teacher else _choose(logits, loop.opts, gen)
        event = _produced(loop, done, i, token, logits, step_ms, teacher, i == steps - 1)
        paused = time.perf_counter()
        fed = yield event
        suspended += time.perf_counter() - paused
        if event.last:
            break
        logits, step_ms = loop.decode_step(token, prefill + i, i + 1, fed)
        if fed is not None:  # this run's share of the batched forward is its own time
            suspended -= fed[1]
    return done.finished(loop, time.perf_counter() - t0 - suspended, teacher, meta)


def _produced(
    loop: _Loop, done: _Progress, i: int, token: int, logits, step_ms: float, teacher: bool, end: bool
) -> StepEvent:
    """Step `i`'s token chosen (or scored) from `logits` `(V,)`, which took `step_ms`: into `done`'s record
    (its NLL, the step's ms from step 1 on), and its event, which can fork the run as it stands before it.
    The run's last step at `end`, or at the end-of-sequence token when generating and asked to stop."""
    with torch.inference_mode():
        nll = float(-torch.log_softmax(logits.float(), dim=-1)[token])
        done.tokens.append(token)
        done.nlls.append(nll)
        if i:
            done.ms.append(step_ms)
        eos = not teacher and loop.opts.stop_at_eos and token == loop.model.tokenizer.eos_token_id
        event = loop.event(i, token, nll, step_ms, logits, end or eos)
    event.fork = (
        lambda: fork(
            loop,
            _Progress(  # ms holds steps 1..i
                done.prompt, i, logits, done.tokens[:i], done.nlls[:i], done.ms[:i], done.prefill_ms, step_ms
            ),
        )
    )
    return event


def decode_from(
    loop: _Loop, prompt: list[int], logits: torch.Tensor, prefill_ms: float, ids, steps: int, teacher: bool
) -> Generator[StepEvent, Fed | None, Run]:
    """The decode steps of a loop whose prompt is in its cache already (restored from a shared prefill that,
    with its compression, took this run `prefill_ms`), from the prompt's last logits `(V,)`."""
    done = _Progress(list(prompt), 0, logits, [], [], [], prefill_ms, prefill_ms)
    return _decode(loop, done, ids, steps, teacher, None, time.perf_counter() - prefill_ms / 1000)


@dataclass
class Fork:
    """A run's state before it chose the token of `progress.step` (`StepEvent.fork`): a copy of its cache, the
    policy's run state and its decision log, sharing the model; `resume` generates on from there."""

    loop: _Loop
    progress: _Progress

    @property
    def before_s(self) -> float:
        """Seconds the run had spent before the fork: its prefill and its steps."""
        return (self.progress.prefill_ms + sum(self.progress.ms)) / 1000


def fork(loop: _Loop, progress: _Progress) -> Fork:
    """Copy `loop` as it stands (only while its run is paused at a step), without its observers, recording the
    summary only."""
    ctx = loop.ctx
    kept = ctx.observers, loop.recorder
    ctx.observed_by([])
    loop.recorder = Recorder()
    try:
        with torch.inference_mode():
            copy = deepcopy(loop, {id(loop.model): loop.model})
    finally:
        ctx.observed_by(kept[0])
        loop.recorder = kept[1]
    copy.ctx.observed_by([copy.recorder])
    return Fork(copy, progress)


def resume(point: Fork, steps: int, meta: dict | None = None) -> Run:
    """Greedy generation from a fork up to `steps` tokens in all, or the end-of-sequence token: the run
    `kvlens generate` would make if its choices before the fork's step were the tokens the fork had. Its
    `total_s` counts what the fork had done before (`Fork.before_s`) and the steps generated here."""
    return drain(resumed(point, steps, meta))


def resumed(point: Fork, steps: int, meta: dict | None = None) -> Generator[StepEvent, Fed | None, Run]:
    """`resume` one step at a time (a decode generator, `kvlens.engine.lockstep` drives several)."""
    loop, done = point.loop, point.progress
    loop.opts = dataclasses.replace(loop.opts, temperature=0.0, stop_at_eos=True)
    progress = dataclasses.replace(done, tokens=list(done.tokens), nlls=list(done.nlls), ms=list(done.ms))
    return _decode(loop, progress, done.prompt, steps, False, meta, time.perf_counter() - point.before_s)


def _make_run(loop: _Loop, model, prompt_ids, tokens, nlls, ms, prefill_ms, total_s, teacher, meta) -> Run:
    """The finished run: its recorded tensors, its `RunMeta` (with `meta`'s extra entries: `command`,
    `made_in`) and its decisions."""
    # (tokens, L, Hkv): the kept counts after the prompt's compression, then after each step's
    kept = torch.stack(loop.kept[: len(tokens)])
    tensors = loop.recorder.finish()
    tensors["steps/nll"] = torch.tensor(nlls, dtype=torch.float32)
    tensors["steps/kv_slots"] = kept.to(torch.int32)
    if loop.channels is not None:
        tensors["kv_channels"] = loop.channels.to(torch.int32)  # (L, Hkv, K) each KV head's kept key channels
    nll, dtype = sum(nlls) / len(nlls), str(loop.recorder.dtype).removeprefix("torch.")
    info = RunMeta(
        mode="teacher" if teacher else "generate",
        **_settings(loop, model),
        **_texts(model.tokenizer, prompt_ids, tokens),
        metrics={
            "nll": nll,
            "ppl": math.exp(nll),
            **_cache_metrics(loop, kept, len(prompt_ids), len(tokens)),
            **_time_metrics(loop, ms, prefill_ms, total_s),
        },
        record=Record(level=loop.recorder.level, layers=loop.opts.record_layers, dtype=dtype),
        **(meta or {}),
    )
    run_ = Run(meta=info, tensors=tensors)
    if loop.log is not None:
        run_.decisions = loop.log.frame()
    return run_


def _settings(loop: _Loop, model: LoadedModel) -> dict[str, Any]:
    """`RunMeta`'s model, policy, storage, budget and sampling entries."""
    opts = loop.opts
    return {
        "model": ModelInfo(
            spec=model.spec,
            shape=model.shape(),
            device=str(model.device),
            dtype=str(model.dtype).removeprefix("torch."),
        ),
        "policy": PolicyInfo(name=loop.policy.name, params=loop.policy.params()),
        "storage": opts.storage.describe(),
        "prefill_chunk": opts.prefill_chunk,
        "budget": Budget(requested=opts.budget, slots=loop.budget),
        "seed": opts.seed,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
    }


def _texts(tok, prompt_ids: list[int], tokens: list[int]) -> dict[str, Any]:
    """`RunMeta`'s prompt and produced tokens, each as ids, token strings and text."""
    return {
        "prompt": tok.decode(prompt_ids),
        "prompt_tokens": list(prompt_ids),
        "prompt_token_strings": tok.convert_ids_to_tokens(list(prompt_ids)),
        "tokens": tokens,
        "token_strings": tok.convert_ids_to_tokens(tokens),
        "text": tok.decode(tokens),
    }


def _cache_metrics(loop: _Loop, kept: torch.Tensor, prompt: int, produced: int) -> dict[str, Any]:
    """What the cache held: kept slots and entries from `kept` `(produced, L, Hkv)`, the compression ratio
    reached and its bytes."""
    return {
        "kv_slots_max": int(kept.max()),
        "kv_entries_max": int(kept.sum((1, 2)).max()),
        "kv_entries_budget": None if loop.budget is None else loop.budget * kept.shape[1] * kept.shape[2],
        "kv_slots_final_mean": float(kept[-1].float().mean()),
        # the share of the KV pairs seen so far that are gone (kvpress's compression ratio): after the
        # prompt's compression, and after the last step's (prompt + produced - 1 tokens fed)
        "compression_ratio_prompt": 1 - float(kept[0].sum()) / (kept[0].numel() * prompt),
        "compression_ratio_final": 1 - float(kept[-1].sum()) / (kept[-1].numel() * (prompt + produced - 1)),
        "kv_bytes_final": loop.cache.nbytes,
        "kv_bytes_peak": loop.peak_bytes,
        "kv_bytes_prefill": loop.prefill_bytes,
        "kv_bytes_prompt": round(loop.token_bytes * prompt),
    }


def _time_metrics(loop: _Loop, ms: list[float], prefill_ms: float, total_s: float) -> dict[str, Any]:
    """What the run took: ms per decode step, the prefill's (its replay passes included) and the total."""
    return {
        "ms_per_token": (sum(ms) / len(ms)) if ms else None,
        "prefill_ms": prefill_ms,
        "total_s": total_s,
        "replay_passes": loop.replay_passes,
        "replay_ms": loop.replay_ms,
    }
