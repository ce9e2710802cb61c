"""Compare policies on one prompt against the full cache: one measured pass per policy, one table, at the cost
of one batched generation.

The design (what each number means, and what it costs):
- The full cache generates (greedy, exactly `new_tokens` tokens, the perturbation meter on): its
  continuation is *full's text*; its row is measured like the others, so ms per token compare under the
  same conditions (its perturbation comes out 0: the meter's shadow is its cache).
- Each policy is teacher-forced on full's text with the meter on (`kvlens.engine.perturbation.measured`).
  That one pass gives: perplexity on full's text (the same tokens for every policy), KL(p_full ‖
  p_policy) per step along full's text, the output perturbation against the meter's shadow full
  cache, kept slots and peak KV bytes, ms per token (of this measured pass, meter included) and the
  policy's greedy choice at each step. Greedy generation under the policy feeds exactly the same
  tokens until its choice first differs from full's, so the first step whose choice differs *is*
  the first divergence of the policy's own text (up to float rounding between the measured and the
  plain path). The pages show its choice at each step of full's text and the share of steps where it
  agrees with full (`top1_agreement`).
- Each entry's own text (`own_text`) is what `kvlens generate` writes with the same settings (greedy, up to
  `new_tokens` or the end-of-sequence token), and it needs no generation from the prompt: up to the first step
  where the measured pass's greedy choice differs from the token it was fed (or that token ends the text), the
  own text *is* the measured text, so the measured pass is forked there (`kvlens.engine.loop.fork`: a copy of
  its cache, the policy's state and its decisions) and greedy generation resumes from the fork (`resume`),
  without the meter. Only the steps after the fork are generated (`generated_steps`, timed in `generate_s`); a
  result measured without its own text and asked for it later generates it from the prompt.
- p_full for the KL is the reference's own step distributions (what `measured`'s extra one-shot
  full-cache forward would compute again), so the reference's KL is 0 by construction.
- Cost (`batched`, the default; `kvlens.engine.lockstep`): one prefill shared by every pass, then one batched
  forward per step for all of them: the full cache's generation, each policy's teacher-forced pass (it reads
  the token full chose this step) and each own text from its fork on, each over its own cache with its own
  attention, statistics, compression and meter. So the model's weights are read once per step for every
  row; what each row adds is its own attention and bookkeeping. Decisions and texts are those of the passes
  run one after another (`batched=False`, the reference path) and the numbers agree within float rounding
  (tested). Each row's ms per token is its own attention and compression plus an equal share of the rest of
  the batched forward, and `generate_s` the same share of the steps after its fork. Measured (2026-12-02,
  SmolLM2-135M on one CPU thread with other jobs running; a 421-character prompt of 96 tokens, streaming_llm,
  h2o and cam at 0.5, 24 tokens, `kvlens compare --json`): `wall_s` 4.4 s batched against 8.9 s one after
  another, for one plain generation of the full cache of 1.4 s (`generation_s`).
- Each policy has its own KV storage (`Entry.storage`: the model's dtype, or quantized,
  `kvlens.kvcache.quantize`); the reference always keeps the model's dtype, so a quantized `full` entry is
  a row of its own (quantization alone).
- Results are reused for identical inputs (`ResultCache`, keyed on model, prompt, policy, its
  resolved parameters, budget, storage and new tokens): a second identical comparison, or one where a
  single policy changed, runs only what changed (teacher-forced on the reused full cache's text).

`compare` is shared by `kvlens compare` and the Compare page, so both show the same `table`.
No Streamlit here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlens.engine.lockstep import Row, lockstep, prefilled
from kvlens.engine.loop import (
    Fork,
    RunOptions,
    StepEvent,
    decode_from,
    is_oom,
    out_of_memory,
    prepare_run,
    resume,
    resumed,
    run,
)
from kvlens.engine.models import LoadedModel
from kvlens.engine.perturbation import PerturbationMeter, kl_per_step, summary
from kvlens.errors import KvlensError
from kvlens.experiments.api import encode, generate
from kvlens.figures.wording import suffix
from kvlens.kvcache.quantize import Storage
from kvlens.policies import changed_params, make_policy
from kvlens.runs.run import Run
from kvlens.runs.token_text import TokenText, decode

MAX_POLICIES = 4
FULL = "full"


@dataclass(frozen=True)
class Entry:
    """One policy of a comparison: name, parameters, budget (None for budget-free policies), KV storage."""

    policy: str
    params: dict
    budget: int | float | None
    storage: Storage = Storage()

    @property
    def label(self) -> str:
        from kvlens.figures.plots import storage_label

        extra = ", ".join(f"{k}={v}" for k, v in changed_params(self.policy, self.params).items())
        budget = suffix(" @{:g}", self.budget)
        kv = f" · {storage_label(self.storage.describe(), short=True)}" if self.storage.packed else ""
        return f"{self.policy}{budget}" + suffix(" ({})", extra) + kv


@dataclass
class Result:
    """One row: the measured pass (the full cache's generation, or a policy teacher-forced on its text)."""

    entry: Entry
    run: Run
    picks: list[int]  # the greedy choice at each step (the full cache: its own tokens)
    first_diff: int | None  # first step whose choice differs from full's token (None: never)
    text: TokenText  # the picks decoded jointly, each pick mapped to its characters
    logprobs: torch.Tensor | None = None  # the full cache's: its next-token log-probs per step (steps, V)
    own: Run | None = None  # its own greedy generation, as `kvlens generate` runs it (`own_text`)
    written: TokenText | None = None  # its own tokens decoded jointly
    generate_s: float | None = None  # seconds of that generation
    own_diff: int | None = None  # first token where that text differs from the full cache's own (None: never)
    own_from: int | None = (
        None  # the step its generation resumed from (tokens before it: the measured pass's)
    )

    @property
    def agreement(self) -> float:
        """Share of steps whose choice is the full cache's token."""
        return sum(a == b for a, b in zip(self.picks, self.run.meta.tokens)) / len(self.picks)

    def row(self) -> dict:
        m = self.run.metrics
        return {
            "policy": self.entry.label,
            "name": self.entry.policy,
            "params": self.run.meta.policy.params,
            "budget": self.entry.budget,
            "budget_slots": self.run.meta.budget.slots,
            "first_divergence": self.first_diff,
            "top1_agreement": self.agreement,
            "ppl": m["ppl"],
            "kl": m["kl"],
            "perturbation": m["perturbation_used"],
            "attention_loss": m["attention_loss"],
            "kv_slots_max": m["kv_slots_max"],
            "kv_bytes_peak": m["kv_bytes_peak"],
            "ms_per_token": m["ms_per_token"],
            "storage": self.entry.storage.describe(),
            "generated": None if self.own is None else self.own.meta.text,
            "generated_divergence": self.own_diff,
            "generated_steps": None if self.own is None else len(self.own.meta.tokens) - self.own_from,
        }


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """Index of the first token where the two sequences differ (None if equal)."""
    for i, (a, b) in enumerate(itertools.zip_longest(reference, tokens)):  # the shorter one ends in None
        if a != b:
            return i
    return None


class ResultCache:
    """Results of `compare` by (model, prompt, policy, resolved parameters, budget, new tokens); keeps the
    `size` most recently used. Thread-safe: the app shares one between sessions."""

    def __init__(self, size: int = 64):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(model: LoadedModel, prompt: str, entry: Entry, new_tokens: int) -> tuple:
        params = json.dumps(make_policy(entry.policy, entry.params).params(), sort_keys=True, default=str)
        return (
            model.spec,
            str(model.path),
            str(model.device),
            str(model.dtype),
            prompt,
            entry.policy,
            params,
            repr(entry.budget),
            repr(entry.storage),
            new_tokens,
        )

    def get(self, key: tuple) -> Result | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: tuple, result: Result) -> None:
        with self._lock:
            self._items[key] = result
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


def entries_with_reference(entries: list[Entry]) -> list[Entry]:
    """The full cache first, then each policy once (in order; `full` in the model's dtype only as the
    reference)."""
    if not 1 <= len(entries) <= MAX_POLICIES:
        raise KvlensError(
            f"Compare takes 1 to {MAX_POLICIES} policies besides the full cache; got {len(entries)}."
        )
    out = [Entry(FULL, {}, None)]
    for e in entries:
        make_policy(e.policy, e.params)  # a bad setting is one sentence before anything runs
        if (e.policy != FULL or e.storage.packed) and e not in out:
            out.append(e)
    return out


def compare(
    model: LoadedModel,
    prompt: str,
    entries: list[Entry],
    new_tokens: int,
    on_step: Callable[[Entry, StepEvent], None] | None = None,
    cancel: threading.Event | None = None,
    cache: ResultCache | None = None,
    own_text: bool = True,
    batched: bool = True,
) -> list[Result]:
    """The full cache's measured generation, then each policy's measured teacher-forced pass on its text, and
    (`own_text`) each one's own greedy text, resumed from where it leaves full's text (module docstring).
    `batched`: all the passes not reused from `cache` at once, one batched forward per step
    (`kvlens.engine.lockstep`); else one after another (the reference path). `on_step(entry, event)` follows
    every measured pass; reused results send no events."""
    if new_tokens < 1:
        raise KvlensError("Ask for at least one new token.")
    ids = encode(model, prompt)
    # attention rows and decisions are recorded for the token inspector (the meter computes the rows anyway)
    opts = RunOptions(max_new_tokens=new_tokens, stop_at_eos=False, record="attention")
    todo = entries_with_reference(entries)
    keys = [ResultCache.key(model, prompt, e, new_tokens) for e in todo]
    cache = cache or ResultCache()  # none given: this call's own
    found = [cache.get(key) for key in keys]
    if own_text and found[0] is not None and found[0].own is None:  # the policies' own texts compare to it
        found[0] = _own_text(model, prompt, todo[0], new_tokens, found[0], None, cancel)
    missing = [e for e, r in zip(todo, found, strict=True) if r is None]
    measure = _measure_many if batched else _measure_each
    try:
        fresh = measure(model, ids, missing, found[0], opts, on_step, cancel, own_text) if missing else []
    except (MemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        message = str(err).splitlines()[0][:200]
    else:
        return _collected(model, prompt, todo, keys, found, iter(fresh), new_tokens, cache, own_text, cancel)
    raise out_of_memory(len(ids), new_tokens, message)  # the passes' frames are gone: their memory is freed


def _collected(model, prompt, todo, keys, found, fresh, new_tokens, cache, own_text, cancel) -> list[Result]:
    """The results in `todo`'s order, each reused (`found`) or measured now (the next of `fresh`), with its
    own text if asked; all kept in `cache`."""
    results: list[Result] = []
    for e, key, result in zip(todo, keys, found, strict=True):
        if result is None:
            result = next(fresh)
        elif own_text and result.own is None:  # measured earlier without its own text: generate it afresh
            result = _own_text(model, prompt, e, new_tokens, result, results[0], cancel)
        cache.put(key, result)
        results.append(result)
    return results


def _own_text(
    model, prompt: str, e: Entry, new_tokens: int, result: Result, reference: Result | None, cancel
) -> Result:
    """`result` with the entry's own greedy generation from the prompt (`kvlens generate` with the same
    settings, timed), for a result measured without its own text."""
    opts = RunOptions(budget=e.budget, max_new_tokens=new_tokens, storage=e.storage)
    t = time.perf_counter()
    own = generate(model, prompt, e.policy, e.params, opts=opts, cancel=cancel)
    return _with_own(model, result, own, time.perf_counter() - t, 0, reference)


def _with_own(
    model, result: Result, own: Run, seconds: float, start: int, reference: Result | None
) -> Result:
    """`result` with its own text `own` (`seconds` to generate it from token `start` on) and where that text
    leaves the full cache's own (`reference`'s; None for the reference itself)."""
    diff = None if reference is None else first_difference(reference.own.meta.tokens, own.meta.tokens)
    return dataclasses.replace(
        result,
        own=own,
        written=_decoded(model, own.meta.tokens),
        generate_s=seconds,
        own_diff=diff,
        own_from=start,
    )


def _resumed(model, result: Result, point: Fork, own: Run, reference: Result | None) -> Result:
    """`result` with its own text `own`, generated from the fork `point` on (timed by the run itself: what it
    spent after the fork)."""
    seconds = own.meta.metrics["total_s"] - point.before_s
    return _with_own(model, result, own, seconds, point.progress.step, reference)


class _Measured:
    """One measured pass as it runs (`on_event` sees each step): the greedy choice and the logits at each
    step, the perturbation meter, and the fork its own text resumes from (`own_text`): the first step where
    that text can leave the measured one (its choice differs from the token fed, the token fed ends the text,
    or the last step)."""

    def __init__(self, model: LoadedModel, entry: Entry, opts: RunOptions, own_text: bool, on_step):
        self.entry, self.steps, self.own_text, self.on_step = entry, opts.max_new_tokens, own_text, on_step
        self.eos = model.tokenizer.eos_token_id
        self.picks: list[int] = []
        self.logits: list[torch.Tensor] = []  # (V,) per step
        self.meter = PerturbationMeter()
        self.fork: Fork | None = None

    def on_event(self, event: StepEvent) -> Fork | None:
        """Take one step's event; the fork, at the step the own text resumes from."""
        self.picks.append(int(torch.argmax(event.logits)))
        self.logits.append(event.logits.detach().float().cpu())
        fed = event.token
        made = None
        if (
            self.own_text
            and self.fork is None
            and (self.picks[-1] != fed or fed == self.eos or event.step == self.steps - 1)
        ):
            made = self.fork = event.fork()
        if self.on_step is not None:
            self.on_step(self.entry, event)
        return made

    def result(self, model: LoadedModel, out: Run, reference: Result | None) -> Result:
        """The row of the finished pass `out` (the full cache's generation when `reference` is None): p_full
        for the KL is the reference's own step distributions (`measured`'s extra one-shot full-cache forward
        would give them again)."""
        e, picks = self.entry, self.picks
        logprobs = torch.log_softmax(torch.stack(self.logits), dim=-1)
        out.tensors.update(self.meter.tensors())
        out.tensors["perturbation/kl"] = kl_per_step(
            logprobs if reference is None else reference.logprobs, self.logits
        )
        out.meta.metrics.update(summary(out.tensors))
        if reference is None:
            return Result(e, out, picks, None, _decoded(model, picks), logprobs)
        return Result(
            e, out, picks, first_difference(reference.run.meta.tokens, picks), _decoded(model, picks)
        )


def _measure_each(
    model, ids, entries: list[Entry], reference: Result | None, opts, on_step, cancel, own_text: bool
) -> list[Result]:
    """The entries' measured passes one after another (`reference` None: the first is the full cache's
    generation, the reference of the others)."""
    results: list[Result] = []
    for e in entries:
        results.append(_measure(model, ids, e, reference, opts, on_step, cancel, own_text))
        reference = reference or results[0]
    return results


def _measure(model, ids, e: Entry, reference: Result | None, opts, on_step, cancel, own_text: bool) -> Result:
    """The full cache's generation (`reference` None) or a policy teacher-forced on the reference's tokens,
    with the perturbation meter on (`kvlens.engine.perturbation.measured`, p_full from the reference), then
    (`own_text`) its own text resumed from its fork (`_Measured`)."""
    measured = _Measured(model, e, opts, own_text, on_step)
    tokens = _reference_tokens(reference)
    out = run(
        model,
        make_policy(e.policy, e.params),
        ids + tokens,
        prefill=len(ids),
        steps=opts.max_new_tokens,
        teacher=reference is not None,
        opts=dataclasses.replace(opts, budget=e.budget, storage=e.storage),
        observers=[measured.meter],
        on_step=measured.on_event,
        cancel=cancel,
    )
    result = measured.result(model, out, reference)
    if measured.fork is None:
        return result
    own = resume(measured.fork, opts.max_new_tokens)
    return _resumed(model, result, measured.fork, own, reference)


def _reference_tokens(reference: Result | None) -> list[int]:
    """The tokens a pass is teacher-forced on: the reference's generation (none for the reference itself)."""
    return [] if reference is None else reference.run.meta.tokens


def _measure_many(
    model, ids, entries: list[Entry], reference: Result | None, opts, on_step, cancel, own_text: bool
) -> list[Result]:
    """`_measure_each`'s results from one shared prefill and one batched forward per step for every pass
    (`kvlens.engine.lockstep`): the full cache's generation, if it is among them, writes the text the others
    are teacher-forced on as it goes, and each own text joins the batch from its fork on."""
    n = opts.max_new_tokens
    text = list(ids) + _reference_tokens(reference)
    passes = [_Measured(model, e, opts, own_text, on_step) for e in entries]
    loops = [
        prepare_run(
            model,
            make_policy(e.policy, e.params),
            ids,
            len(ids),
            n,
            False,
            dataclasses.replace(opts, budget=e.budget, storage=e.storage),
            [p.meter],
        )
        for e, p in zip(entries, passes, strict=True)
    ]
    writes = reference is None  # the first pass generates the text
    rows = [
        Row(loop, decode_from(loop, ids, logits, ms, text, n, teacher=k > 0 or not writes), len(ids))
        for k, (loop, (logits, ms)) in enumerate(zip(loops, prefilled(loops, ids), strict=True))
    ]
    owns: dict[int, Row] = {}  # pass index -> its own text's row

    def on_event(row: Row, event: StepEvent) -> list[Row]:
        if row not in rows:
            return []
        k = rows.index(row)
        if writes and k == 0:
            text.append(event.token)
        point = passes[k].on_event(event)
        if point is None:
            return []
        owns[k] = Row(point.loop, resumed(point, n), len(ids))
        return [owns[k]]

    lockstep(rows, on_event, cancel)
    results: list[Result] = []
    ref = reference
    for k, (p, row) in enumerate(zip(passes, rows, strict=True)):
        result = p.result(model, row.run, ref)
        if k in owns:
            result = _resumed(model, result, p.fork, owns[k].run, ref)
        results.append(result)
        ref = ref or results[0]
    return results


def batched_floor(model: LoadedModel, prompt: str, rows: int, new_tokens: int) -> tuple[float, list[int]]:
    """The least any lockstep of `rows` passes can cost on this machine, and the text it wrote: transformers'
    own forward (SDPA, its `DynamicCache`, no kvlens attention, statistics, policy or meter) over one prefill
    of `prompt`, then `new_tokens - 1` greedy decode forwards of `rows` copies of the full cache in one batch
    `(rows, 1)`, every row fed the first row's choice. A comparison measures the full cache and each policy,
    so `rows` is their count; each own text joins the batch from its fork on, so the comparison's batch is at
    least this wide at every step. Seconds, and the `new_tokens` tokens of the first row (the full cache's
    greedy text)."""
    from transformers import DynamicCache

    ids = torch.tensor([encode(model, prompt)], device=model.device)
    t = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        cache.batch_repeat_interleave(rows)
        tokens = [int(logits[0, -1].argmax())]
        for step in range(new_tokens - 1):
            position = torch.full((rows, 1), ids.shape[1] + step, device=model.device)
            logits = model.model(
                input_ids=torch.full((rows, 1), tokens[-1], device=model.device),
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            tokens.append(int(logits[0, -1].argmax()))
    return time.perf_counter() - t, tokens


def _decoded(model: LoadedModel, tokens: list[int]) -> TokenText:
    return decode(model.tokenizer.convert_ids_to_tokens(tokens))


def table(results: list[Result]) -> list[dict]:
    """One row per result (the full cache first): what `kvlens compare --json` prints and the page shows."""
    return [r.row() for r in results]
