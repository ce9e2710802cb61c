"""Compare policies on one prompt against the full cache: one measured pass per policy, one table.

The design (what each number means, and why it costs one pass per policy):
- The full cache generates first (greedy, exactly `new_tokens` tokens, the perturbation meter on):
  its continuation is *full's text*; its row is measured like the others, so ms per token compare
  under the same conditions (its perturbation comes out 0: the meter's shadow is its cache).
- Each policy is then teacher-forced on full's text with the meter on (`kvlens.engine.perturbation.measured`).
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
- Cost: one measured pass per policy, plus the steps of each own text after its divergence
  (`kvlens compare` prints both times).
- Each policy has its own KV storage (`Entry.storage`: the model's dtype, or quantized,
  `kvlens.kvcache.quantize`); the reference always keeps the model's dtype, so a quantized `full` entry is
  a row of its own (quantization alone).
- Results are reused for identical inputs (`ResultCache`, keyed on model, prompt, policy, its
  resolved parameters, budget, storage and new tokens): a second identical comparison, or one where a
  single policy changed, runs only what changed.

`compare` is shared by `kvlens compare` and the Compare page, so both show the same `table`.
No Streamlit here.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlens.engine.loop import Fork, RunOptions, StepEvent, resume, run
from kvlens.engine.models import LoadedModel
from kvlens.engine.perturbation import PerturbationMeter, kl_per_step, summary
from kvlens.errors import KvlensError
from kvlens.experiments.api import encode, generate
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
        budget = "" if self.budget is None else f" @{self.budget:g}"
        kv = f" · {storage_label(self.storage.describe(), short=True)}" if self.storage.packed else ""
        return f"{self.policy}{budget}" + (f" ({extra})" if extra else "") + kv


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
        return sum(a == b for a, b in zip(self.picks, self.run.meta["tokens"])) / len(self.picks)

    def row(self) -> dict:
        m = self.run.metrics
        return {
            "policy": self.entry.label,
            "name": self.entry.policy,
            "params": self.run.meta["policy"]["params"],
            "budget": self.entry.budget,
            "budget_slots": self.run.meta["budget"]["slots"],
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
            "generated": None if self.own is None else self.own.meta["text"],
            "generated_divergence": self.own_diff,
            "generated_steps": None if self.own is None else len(self.own.meta["tokens"]) - self.own_from,
        }


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """Index of the first token where the two sequences differ (None if equal)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


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
) -> list[Result]:
    """The full cache's measured generation, then each policy's measured teacher-forced pass on its text, and
    (`own_text`) each one's own greedy text, resumed from where it leaves full's text (module docstring).
    `on_step(entry, event)` follows every measured pass; reused results send no events."""
    if new_tokens < 1:
        raise KvlensError("Ask for at least one new token.")
    ids = encode(model, prompt)
    # attention rows and decisions are recorded for the token inspector (the meter computes the rows anyway)
    opts = RunOptions(max_new_tokens=new_tokens, stop_at_eos=False, record="attention")
    results: list[Result] = []
    for e in entries_with_reference(entries):
        key = ResultCache.key(model, prompt, e, new_tokens)
        result = cache.get(key) if cache is not None else None
        if result is None:
            result = _measure(model, ids, e, results[0] if results else None, opts, on_step, cancel, own_text)
        elif own_text and result.own is None:  # measured earlier without its own text: generate it afresh
            result = _own_text(model, prompt, e, new_tokens, result, results[0] if results else None, cancel)
        if cache is not None:
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
    diff = None if reference is None else first_difference(reference.own.meta["tokens"], own.meta["tokens"])
    return dataclasses.replace(
        result,
        own=own,
        written=_decoded(model, own.meta["tokens"]),
        generate_s=seconds,
        own_diff=diff,
        own_from=start,
    )


def _measure(model, ids, e: Entry, reference: Result | None, opts, on_step, cancel, own_text: bool) -> Result:
    """The full cache's generation (`reference` None) or a policy teacher-forced on the reference's tokens,
    with the perturbation meter on (`kvlens.engine.perturbation.measured`, except that p_full is the
    reference's own step distributions: the one-shot full-cache forward `measured` would add gives them
    again). With `own_text`, the run is forked at the first step where its own greedy text can leave the
    measured one (its choice differs from the token fed, the token fed ends the text, or the last step), and
    resumed from there."""
    picks: list[int] = []
    logits: list[torch.Tensor] = []
    meter = PerturbationMeter()
    tokens = None if reference is None else reference.run.meta["tokens"]
    eos = model.tokenizer.eos_token_id
    forks: list[Fork] = []

    def step(event: StepEvent):
        picks.append(int(torch.argmax(event.logits)))
        logits.append(event.logits.detach().float().cpu())
        fed = event.token
        if (
            own_text
            and not forks
            and (picks[-1] != fed or fed == eos or event.step == opts.max_new_tokens - 1)
        ):
            forks.append(event.fork())
        if on_step is not None:
            on_step(e, event)

    opts = dataclasses.replace(opts, budget=e.budget, storage=e.storage)
    if reference is None:
        out = run(
            model,
            make_policy(e.policy, e.params),
            ids,
            prefill=len(ids),
            steps=opts.max_new_tokens,
            teacher=False,
            opts=opts,
            observers=[meter],
            on_step=step,
            cancel=cancel,
        )
    else:
        out = run(
            model,
            make_policy(e.policy, e.params),
            ids + tokens,
            prefill=len(ids),
            steps=len(tokens),
            teacher=True,
            opts=opts,
            observers=[meter],
            on_step=step,
            cancel=cancel,
        )
    logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
    out.tensors.update(meter.tensors())
    out.tensors["perturbation/kl"] = kl_per_step(
        logprobs if reference is None else reference.logprobs, logits
    )
    out.meta["metrics"].update(summary(out.tensors))
    if reference is None:
        result = Result(e, out, picks, None, _decoded(model, picks), logprobs)
    else:
        result = Result(e, out, picks, first_difference(tokens, picks), _decoded(model, picks))
    if not forks:
        return result
    t = time.perf_counter()
    own = resume(forks[0], opts.max_new_tokens)
    return _with_own(model, result, own, time.perf_counter() - t, forks[0].progress.step, reference)


def _decoded(model: LoadedModel, tokens: list[int]) -> TokenText:
    return decode(model.tokenizer.convert_ids_to_tokens(tokens))


def table(results: list[Result]) -> list[dict]:
    """One row per result (the full cache first): what `kvlens compare --json` prints and the page shows."""
    return [r.row() for r in results]
