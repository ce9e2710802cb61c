"""Speed and memory per policy, and the target ratios (`TARGETS`), measured side by side in one run.

Per policy and prompt length: prefill ms, median ms per generated token, KV bytes allocated
(peak after compression) and the process's peak resident memory. Each ratio compares sides run
in lockstep on the same prompt (`lockstep`: the prefills in turn, then one decode step of each side
in turn, ...), so load from other processes and the machine's drift hit every side alike; which side
goes first flips or rotates each repeat. A ratio is the median over repeats of the per-repeat ratio
of median decode ms/token (wall clock). `ratios_cpu` gives the same ratios in process CPU time per
step, which a machine shared with other processes disturbs less than wall time.

- engine_vs_model_loop: engine `full`, summary recording (the least there is), vs the model's
  own greedy decode loop over a transformers `DynamicCache` with plain SDPA (the `kvlens`
  attention falls back to SDPA without a run context). Same prompt, same greedy tokens.
- hf_generate_vs_engine: transformers' own `model.generate` with `kvlens.cache(model, "full")` vs the engine's
  `full`, same prompt, same greedy tokens: what running inside the caller's transformers code costs.
- cam_vs_streaming_llm: `cam` (base streaming_llm) vs `streaming_llm`, both at the same budget.
- record_full_vs_none: engine `full` with `record="attention"` vs `record="summary"`.
- kv_bytes_half_budget_vs_full: KV bytes allocated by `streaming_llm` at half the prompt vs the
  full prompt's cache; proportional means the slot share (budget + the step's token).
- evict_half_vs_full_at_N: ms/token of `streaming_llm` and of `h2o` at half the prompt over `full`
  on an N-token prompt (N capped so that prompt + steps fit the model's context), the worse of the
  two; full, streaming_llm, h2o and tova in lockstep, the order rotating each repeat.
- prefill_stats_vs_full: prefill + step-0 compression ms of `h2o` (column sums) and of `tova`
  (last rows) over `full`'s prefill, at the first evict length, the worse of the two.
- every_policy_half_vs_full_at_N, every_policy_prefill_vs_full_at_N: the same two measurements for every
  policy in the lockstep (`every`: by default every registered policy, budget-free ones at their own size),
  the worst policy's ratio; `ratio_details` names it and lists each policy's. The prefill family leaves out
  the methods whose algorithm is an extra forward over the prompt (replay passes: KVzip's reconstruction),
  which `replay_vs_full_prefill_at_N` measures against their own target; `kvzap_vs_kvzip_prefill_at_N` is
  KVzap's prefill (its surrogate's matmuls) over KVzip's (its replay), the cost the learned score saves (no
  target), and each one's decode over full is in `every_policy_half_vs_full_at_N`.
- replay_floor_vs_full_prefill_at_N: the worst replay method's passes' forward alone (`replay_forward`: the
  same passes, read by nothing, nothing evicted) over the full prefill, in the same lockstep: what its rule
  costs before it scores anything. Where it misses the replay target too, the method is named as the
  exception (`targets`).
- column_sums_floor_vs_full_prefill_at_N: H2O's column sums of the prompt's attention alone
  (`statistics_alone`: computed and observed, nothing evicted) over the full prefill, in the lockstep group of
  the worst method that reads them (H2O, Scissorhands, CaM, WeightedKV, D2O, KVMerger; `reads_column_sums`).
  Where it misses the prefill target too (CPU time) and the family's worst reads column sums, that method is
  named as the exception.
- every_policy_bytes_half_vs_full_at_N: KV bytes allocated (peak) by every budgeted policy at half the prompt
  over the full cache's (peak) after the same steps, the worst policy's: both hold the generated tokens, so a
  method that compresses the prompt once and then grows is held to the same count as one that keeps its
  budget (per-head budgets in pages show their page rounding here).
- every_policy_vs_floor_at_N: each policy's decode ms/token over its **floor**, the full cache on as many
  tokens as the policy keeps, in the same lockstep: `full` on the prompt's first N/2 tokens for a policy at
  half budget, on the tokens it kept for a budget-free one (measured by an untimed run first). Both sides do
  the same model work over the same number of slots, so the ratio is what the method itself costs per step.

With `every`, the policies run in groups (`group` policies each, `lockstep_groups`), one group after the
other, each beside its own full cache and floors, so that only one group's caches are alive at a time and each
ratio compares sides of the same lockstep. Each length runs at least 3 rounds (`every_rounds`);
`ratio_details` gives each policy's median [min, max] over the rounds (`spread`) in wall-clock and in CPU time
(`cpu`, `cpu_spread`), and prefill targets are judged in CPU time (`CPU_TARGETS`).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence

import torch

from kvlens.engine.loop import RunOptions, run_steps
from kvlens.engine.models import LoadedModel
from kvlens.errors import KvlensError
from kvlens.experiments.bench.common import PeakRSS, PolicySpec, environment, median
from kvlens.experiments.bench.rule_floors import replay_forward, statistics_alone
from kvlens.figures.wording import IN_CPU_TIME, when
from kvlens.policies import Policy, Replays, make_policy
from kvlens.texts import prefix_ids

# KVzap's surrogate (prefill and one matmul per layer per token) against the KVzip replay it approximates:
# `kvzap_vs_kvzip_prefill_at_N`, their prefills' median per-round ratio (wall and CPU time); no target
LEARNED = ("kvzap", "kvzip")
TIMES = {"wall": "prefill_ms", "cpu": "prefill_cpu_ms"}
TARGETS = {
    "engine_vs_model_loop": 1.03,
    "hf_generate_vs_engine": 1.10,
    "cam_vs_streaming_llm": 1.10,
    "record_full_vs_none": 1.5,
    "evict_half_vs_full_at_1024": 0.98,
    "evict_half_vs_full_at_4096": 0.90,
    "evict_half_vs_full_at_8192": 0.85,
    "prefill_stats_vs_full": 1.30,
    "every_policy_half_vs_full_at_1024": 1.00,
    "every_policy_half_vs_full_at_4096": 0.90,
    "every_policy_half_vs_full_at_8160": 0.80,
    "every_policy_vs_floor_at_4096": 1.15,
    "every_policy_vs_floor_at_8160": 1.10,
    "every_policy_prefill_vs_full_at_1024": 1.30,
    "every_policy_prefill_vs_full_at_4096": 1.30,
    "every_policy_prefill_vs_full_at_8160": 1.30,
    "replay_vs_full_prefill_at_1024": 2.5,
    "replay_vs_full_prefill_at_4096": 2.5,
    **{f"every_policy_bytes_half_vs_full_at_{n}": 0.52 for n in (1024, 4096, 8160)},
}
CPU_TARGETS = ("every_policy_prefill_vs_full_at_",)  # judged on `ratios_cpu` (process CPU time)
FLOOR = "floor"  # the lockstep side of the full cache on the tokens a half budget keeps
REPLAY_FLOOR = "replay_floor"  # the lockstep side of a replay method's passes' forward alone
COLUMN_SUMS_FLOOR = "column_sums_floor"  # the lockstep side of H2O's column sums alone (`statistics_alone`)
EVICTING = ("streaming_llm", "h2o")  # the evict ratios: the worse of these over full
STATS = ("h2o", "tova")  # the prefill ratio: the worse of these over full
Steps = Generator[float, None, dict]  # one side of a lockstep: its step times (ms), then its results


def engine_steps(
    model: LoadedModel, spec: PolicySpec | Policy, ids: list[int], steps: int, budget, record: str = "summary"
) -> Generator[float, None, dict]:
    """One greedy engine run of a policy (named, or built: a floor's), one step per `next`: yields the prefill
    ms, then each decode step's ms (forward + compression); returns KV bytes, kept slots and the tokens."""
    policy = spec if isinstance(spec, Policy) else make_policy(spec.name, dict(spec.params))
    opts = RunOptions(
        budget=None if policy.budget_free else budget,
        max_new_tokens=steps,
        stop_at_eos=False,
        record=record,
        log_decisions=False,
    )
    events = run_steps(
        model,
        policy,
        ids,
        prefill=len(ids),
        steps=steps,
        teacher=False,
        opts=opts,
    )
    while True:
        try:
            event = next(events)
        except StopIteration as done:
            m = done.value.metrics
            return {
                "kv_bytes_peak": m["kv_bytes_peak"],
                "kv_bytes_prefill": m["kv_bytes_prefill"],
                "kv_slots_max": m["kv_slots_max"],
                "kv_slots_final_mean": m["kv_slots_final_mean"],
                "replay_passes": m["replay_passes"],
                "replay_ms": m["replay_ms"],
                "tokens": done.value.meta.tokens,
            }
        yield event.ms


def model_loop_steps(model: LoadedModel, ids: list[int], steps: int) -> Generator[float, None, dict]:
    """The model's own cached greedy loop (`DynamicCache`, one token per call, SDPA attention), one step
    per `next`: yields the prefill ms, then each decode step's ms; returns the tokens."""
    from transformers import DynamicCache

    dev = model.device
    cache, tokens = DynamicCache(), []
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.model(
            input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
    yield (time.perf_counter() - t) * 1000
    for i in range(steps):
        token = int(torch.argmax(out.logits[0, -1]))
        tokens.append(token)
        if i == steps - 1:
            break
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.model(
                input_ids=torch.tensor([[token]], device=dev), past_key_values=cache, use_cache=True
            )
        yield (time.perf_counter() - t) * 1000
    return {"tokens": tokens}


def hf_generate_steps(model: LoadedModel, ids: list[int], steps: int) -> Generator[float, None, dict]:
    """transformers' `model.generate` with a `kvlens.cache(model, "full")`, one step per `next`: generate runs
    in a thread that a streamer holds after each token until the next `next`. Yields the prefill ms (prompt to
    first token), then each decode step's ms; returns the tokens."""
    from kvlens.hf import cache

    gate = _Gate()
    kv = cache(model.model, "full", tokenizer=model.tokenizer)
    prompt = torch.tensor([ids], device=model.device)
    worker = threading.Thread(
        target=gate.run,
        args=(
            lambda: model.model.generate(
                prompt,
                past_key_values=kv,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                streamer=gate,
            ),
        ),
    )
    worker.start()
    try:
        for ms in iter(gate.times.get, None):
            yield ms
            gate.go.put(True)
    finally:
        worker.join()
    if gate.error is not None:
        raise gate.error
    return {"tokens": gate.tokens}


class _Gate:
    """A `generate` streamer that reports each token's time (from the previous release) and waits to be
    released."""

    def __init__(self):
        self.times: queue.Queue = queue.Queue()
        self.go: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self._t = 0.0
        self._prompt = True

    def run(self, generate: Callable[[], object]) -> None:
        try:
            generate()
        except BaseException as err:  # noqa: BLE001 - handed to the bench's thread
            self.error = err
        finally:
            self.times.put(None)

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:  # generate streams the prompt first
            self._prompt = False
            self._t = time.perf_counter()
            return
        self.times.put((time.perf_counter() - self._t) * 1000)
        self.tokens.append(int(value.reshape(-1)[0]))
        self.go.get()
        self._t = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def lockstep(sides: dict[str, Callable[[], Steps]]) -> dict[str, dict]:
    """Advance the sides' runs in turn, one step each, in the dict's order: prefills one after the
    other, then step 1 of each, step 2 of each, ... so that load and drift hit every side alike.

    Per side: prefill_ms, ms_per_token (median decode step, wall) and cpu_ms_per_token (median
    process CPU time of its steps), plus what its generator returns."""
    runs = {name: make() for name, make in sides.items()}
    ms: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, dict] = {}
    while len(out) < len(runs):
        for name, steps in runs.items():
            if name in out:
                continue
            c = time.process_time()
            try:
                value = next(steps)
            except StopIteration as done:
                out[name] = {
                    "prefill_ms": ms[name][0],
                    "prefill_cpu_ms": cpu[name][0],
                    "ms_per_token": median(ms[name][1:]),
                    "cpu_ms_per_token": median(cpu[name][1:]),
                    **done.value,
                }
                continue
            cpu[name].append((time.process_time() - c) * 1000)
            ms[name].append(value)
    return {name: out[name] for name in runs}


def engine_once(
    model: LoadedModel, spec: PolicySpec, ids: list[int], steps: int, budget, record: str = "summary"
) -> dict:
    """One engine run alone (a table row): prefill ms, median ms/token, KV bytes, peak RSS (and on a CUDA GPU
    its peak, `torch.cuda.max_memory_allocated`), its tokens."""
    with PeakRSS(device=model.device) as mem:
        res = lockstep({"run": lambda: engine_steps(model, spec, ids, steps, budget, record)})["run"]
    gpu = {} if mem.device_peak is None else {"peak_gpu_memory": mem.device_peak}
    return {**res, "peak_rss": mem.peak, "rss_growth": mem.peak - mem.start, **gpu}


def paired(a: Callable[[], Steps], b: Callable[[], Steps], repeats: int, tick: Callable[[], None]) -> dict:
    """a and b in lockstep `repeats` times (which goes first flips each repeat); median of the ms/token
    ratios."""
    sides: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(repeats):
        order = ("ab", "ba")[r % 2]
        res = lockstep({side: {"a": a, "b": b}[side] for side in order})
        for side in order:
            sides[side].append(res[side])
            tick()
    ratios = [x["ms_per_token"] / y["ms_per_token"] for x, y in zip(sides["a"], sides["b"], strict=True)]
    cpu = [x["cpu_ms_per_token"] / y["cpu_ms_per_token"] for x, y in zip(sides["a"], sides["b"], strict=True)]
    return {
        "ratio": median(ratios),
        "ratios": ratios,
        "a_ms_per_token": [x["ms_per_token"] for x in sides["a"]],
        "b_ms_per_token": [y["ms_per_token"] for y in sides["b"]],
        "cpu_ratio": median(cpu),
        "cpu_ratios": cpu,
        "same_tokens": all(x["tokens"] == y["tokens"] for x, y in zip(sides["a"], sides["b"], strict=True)),
    }


def rotated(
    runs: dict[str, Callable[[], Steps]], repeats: int, tick: Callable[[], None]
) -> dict[str, list[dict]]:
    """Every side in lockstep once per repeat, the order rotating each repeat; results per side."""
    names = list(runs)
    out: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        res = lockstep({name: runs[name] for name in order})
        for name in order:
            out[name].append(res[name])
            tick()
    return out


def evict_repeats(repeats: int, n: int, every: Sequence[str] = ()) -> int:
    """Rotations at an n-token prompt: fewer for long prompts, whose prefill dominates the time, unless every
    policy is measured (`every_rounds`)."""
    if every:
        return every_rounds(repeats)
    return min(repeats, max(1, repeats * 1024 // n))


def every_rounds(repeats: int) -> int:
    """Rounds of the every-policy lockstep: at least 3, so that each ratio has a median and a spread."""
    return max(3, repeats)


def lockstep_names(every: Sequence[str]) -> list[str]:
    """The sides of the evict ratios: full, the evicting and statistics policies, then `every` other
    policy."""
    return list(dict.fromkeys(("full", *EVICTING, *STATS, *every)))


def lockstep_groups(every: Sequence[str], size: int = 0) -> list[list[str]]:
    """The evict lockstep's groups, each run alone beside its own `full` (and floors, `group_floors`), so that
    only one group's caches are alive at a time: the evicting and statistics policies, then `every` other
    policy, `size` policies a group (0: all in one), KVzap in KVzip's group (their prefill ratio)."""
    rest = [name for name in lockstep_names(every) if name != "full"]
    both = all(name in rest for name in LEARNED)
    units = [
        [name, LEARNED[0]] if both and name == LEARNED[1] else [name]
        for name in rest
        if not (both and name == LEARNED[0])
    ]
    chunks: list[list[str]] = [[]]
    for unit in units:
        if size and chunks[-1] and len(chunks[-1]) + len(unit) > size:
            chunks.append([])
        chunks[-1].extend(unit)
    return [["full", *chunk] for chunk in chunks]


def group_floors(group: Sequence[str], every: Sequence[str]) -> list[str]:
    """The floor sides a lockstep group needs: one for each of its `every` policies (`floor_of`), once, then
    the replay floor of each that feeds replay passes (`replay_floor_of`), and the column-sums floor of its
    first policy that reads them (`column_sums_floor_of`)."""
    mine = [name for name in group if name in every]
    replays = [replay_floor_of(name) for name in mine if isinstance(make_policy(name), Replays)]
    sums = [column_sums_floor_of(name) for name in mine if reads_column_sums(name)][:1]
    return list(dict.fromkeys([*(floor_of(name) for name in mine), *replays, *sums]))


def reads_column_sums(name: str) -> bool:
    """Whether a policy's prefill computes the column sums of the prompt's attention (H2O's score; a replay
    method's come from its passes)."""
    policy = make_policy(name)
    return policy.needs().column_sums and not isinstance(policy, Replays)


def column_sums_floor_of(name: str) -> str:
    """The lockstep side that holds H2O's column sums alone (`statistics_alone`) on the same prompt, in the
    group of `name`, its first policy that reads them."""
    return f"{COLUMN_SUMS_FLOOR}:{name}"


def replay_floor_of(name: str) -> str:
    """The lockstep side a replay policy's prefill is held against: its passes' forward alone
    (`replay_forward`) on the same prompt."""
    return f"{REPLAY_FLOOR}:{name}"


def group_runs(
    model: LoadedModel,
    names: Sequence[str],
    every: Sequence[str],
    ids: list[int],
    floors: dict,
    steps: int,
    budget: float,
) -> dict[str, Callable[[], Steps]]:
    """A lockstep group's sides: its policies (`full` first) at `budget` on `ids`, then their floors."""
    runs = {
        name: functools.partial(engine_steps, model, PolicySpec(name), ids, steps, budget) for name in names
    }
    return {
        **runs,
        **{side: floor_run(model, side, ids, floors, steps) for side in group_floors(names, every)},
    }


def floor_run(model: LoadedModel, side: str, ids: list[int], floors: dict, steps: int) -> Callable[[], Steps]:
    """A floor side's run: the full cache on its prompt (`floor_sides`), or a policy's replay floor or H2O's
    column sums alone on the whole prompt."""
    kind, _, name = side.partition(":")
    if kind == REPLAY_FLOOR:
        return functools.partial(engine_steps, model, replay_forward(make_policy(name)), ids, steps, None)
    if kind == COLUMN_SUMS_FLOOR:
        return functools.partial(engine_steps, model, statistics_alone(make_policy("h2o")), ids, steps, None)
    return functools.partial(engine_steps, model, PolicySpec("full"), floors[side], steps, None)


def floor_sides(
    model: LoadedModel, ids: list[int], steps: int, budget: float, every: Sequence[str]
) -> dict[str, list[int]]:
    """The floors' prompts, by side name: `FLOOR` the first `budget` share of `ids` (what a budgeted policy
    keeps), and one per budget-free policy of `every`, on as many tokens as it keeps per KV head on average
    at its last step (an untimed run), less the tokens generated since the prompt."""
    slots = max(1, round(budget * len(ids)))
    out = {FLOOR: ids[:slots]} if any(not PolicySpec(n).budget_free for n in every) else {}
    for name in every:
        if PolicySpec(name).budget_free:
            seen = lockstep({name: lambda name=name: engine_steps(model, PolicySpec(name), ids, steps, None)})
            kept = round(seen[name]["kv_slots_final_mean"]) - (steps - 1)
            out[f"{FLOOR}:{name}"] = ids[: min(len(ids), max(1, kept))]
    return out


def floor_of(name: str) -> str:
    """The lockstep side a policy's decode is held against (`floor_sides`)."""
    return f"{FLOOR}:{name}" if PolicySpec(name).budget_free else FLOOR


def evict_ratios(
    model: LoadedModel,
    text: str,
    n: int,
    steps: int,
    budget: float,
    repeats: int,
    tick: Callable[[], None],
    every: Sequence[str] = (),
    group: int = 0,
) -> dict:
    """full, streaming_llm, h2o, tova and `every` other policy on one n-token prompt, rotated in groups of
    `group` policies (`lockstep_groups`), each beside its own full cache and floors: decode and prefill
    (+ step-0 compression) ratios over its group's full, per policy; the worst of `every` named."""
    n = min(n, (model.shape()["context"] or n + steps) - steps)
    ids = prefix_ids(model, text, n, "The text")
    floors = floor_sides(model, ids, steps, budget, every)
    runs = (
        group_runs(model, names, every, ids, floors, steps, budget) for names in lockstep_groups(every, group)
    )
    groups = [rotated(sides, evict_repeats(repeats, n, every), tick) for sides in runs]  # one after the other
    own = {side: sides for sides in groups for side in sides if side != "full"}  # each side's group

    def per_round(name, key, against="full"):
        return [a[key] / b[key] for a, b in zip(own[name][name], own[name][against], strict=True)]

    def ratio(name, key, against="full"):
        return median(per_round(name, key, against))

    others = [name for name in lockstep_names(every) if name != "full"]
    decode = {name: ratio(name, "ms_per_token") for name in others}
    prefill = {name: ratio(name, "prefill_ms") for name in others}
    families = {  # the every-policy families: (key in the sides, against which side)
        "decode": ("ms_per_token", "cpu_ms_per_token", lambda name: "full"),
        "prefill": ("prefill_ms", "prefill_cpu_ms", lambda name: "full"),
        "floor": ("ms_per_token", "cpu_ms_per_token", floor_of),
    }
    rounds = {
        part: {
            name: {
                "wall": per_round(name, wall, against(name)),
                "cpu": per_round(name, cpu, against(name)),
            }
            for name in every
        }
        for part, (wall, cpu, against) in families.items()
    }
    whole = median(x["kv_bytes_peak"] for x in groups[0]["full"])  # the full cache after the same steps
    nbytes = {
        name: median(x["kv_bytes_peak"] for x in own[name][name]) / whole
        for name in others
        if not PolicySpec(name).budget_free
    }
    replays = [name for name in others if own[name][name][0]["replay_passes"]]  # prefill holds replay passes
    out = {
        "prompt_tokens": n,
        "decode": decode,
        "prefill": prefill,
        "bytes": nbytes,
        "replay": {name: prefill[name] for name in replays},
        **rule_floor_rounds(own, per_round, replays, every),
        "rounds": rounds,
        "floor_tokens": {side: len(prompt) for side, prompt in floors.items()},
        "ratio": max(decode[name] for name in EVICTING),
        "prefill_ratio": max(prefill[name] for name in STATS),
        "groups": [list(sides) for sides in groups],
        "ms_per_token": [{k: [x["ms_per_token"] for x in v] for k, v in sides.items()} for sides in groups],
        "prefill_ms": [{k: [x["prefill_ms"] for x in v] for k, v in sides.items()} for sides in groups],
    }
    if every:
        out["worst_bytes"] = max((name for name in every if name in nbytes), key=nbytes.__getitem__)
    if all(name in others for name in LEARNED):  # the surrogate's prefill over the replay it approximates
        out["learned"] = {t: ratio(LEARNED[0], key, LEARNED[1]) for t, key in TIMES.items()}
    return out


def rule_floor_rounds(
    own: dict, per_round: Callable[[str, str], list[float]], replays: Sequence[str], every: Sequence[str]
) -> dict:
    """Each rule floor's per-round prefill over its group's full cache (`TIMES`: wall and CPU; `per_round`
    gives a side's per-round ratio of a key), from `own` (each side's group of lockstep results):
    `replay_floor` for each of the `replays` methods (its passes' forward alone), `column_sums_floor` for each
    policy of `every` that reads column sums (H2O's column sums alone, in its group)."""

    def rounds(side: str) -> dict[str, list[float]]:
        return {unit: per_round(side, key) for unit, key in TIMES.items()}

    return {
        "replay_floor": {
            name: rounds(replay_floor_of(name)) for name in replays if replay_floor_of(name) in own
        },
        "column_sums_floor": {
            name: rounds(side)
            for name in every
            if reads_column_sums(name)
            for side in own[name]
            if side.startswith(COLUMN_SUMS_FLOOR)
        },
    }


def ticks(
    n_policies: int,
    lengths: list[int],
    repeats: int,
    evict_lengths: list[int],
    every: Sequence[str] = (),
    group: int = 0,
) -> int:
    """How many times `bench_speed` calls `tick`."""
    return (
        n_policies * len(lengths)
        + 8 * repeats
        + sum(length_ticks(n, repeats, every, group) for n in evict_lengths)
    )


def length_ticks(n: int, repeats: int, every: Sequence[str] = (), group: int = 0) -> int:
    """How many times `evict_ratios` calls `tick` at an n-token prompt: each side's runs, in every group."""
    sides = sum(len(names) + len(group_floors(names, every)) for names in lockstep_groups(every, group))
    return sides * evict_repeats(repeats, n, every)


def engine_pairs(model: LoadedModel, ids: list[int], steps: int, budget: float, repeats: int, tick) -> dict:
    """The engine's own ratios on prompt `ids`, each two sides paired in lockstep (`paired`): the engine's
    full cache against the model's own loop, transformers' `generate` against the engine, CaM against
    StreamingLLM, and recording attention against recording nothing."""
    full, sl, cam = PolicySpec("full"), PolicySpec("streaming_llm"), PolicySpec("cam")
    engine = lambda: engine_steps(model, full, ids, steps, budget)  # noqa: E731
    return {
        "engine_vs_model_loop": paired(engine, lambda: model_loop_steps(model, ids, steps), repeats, tick),
        "hf_generate_vs_engine": paired(lambda: hf_generate_steps(model, ids, steps), engine, repeats, tick),
        "cam_vs_streaming_llm": paired(
            lambda: engine_steps(model, cam, ids, steps, budget),
            lambda: engine_steps(model, sl, ids, steps, budget),
            repeats,
            tick,
        ),
        "record_full_vs_none": paired(
            lambda: engine_steps(model, full, ids, steps, budget, record="attention"), engine, repeats, tick
        ),
    }


def every_policy_ratios(e: dict) -> tuple[dict, dict, dict]:
    """The `every_policy_*` ratios (and KVzap's prefill over KVzip's) of one evict lockstep `e`
    (`evict_ratios` with `every`): in wall-clock time, in CPU time, and their details (each policy's median
    and spread, the worst named)."""
    m = e["prompt_tokens"]  # 8192 is capped at the context minus the steps
    ratios, ratios_cpu, details = {}, {}, {}
    if "learned" in e:
        name = f"{LEARNED[0]}_vs_{LEARNED[1]}_prefill_at_{m}"
        ratios[name], ratios_cpu[name] = e["learned"]["wall"], e["learned"]["cpu"]
        prefill = next(sides for sides in e["prefill_ms"] if LEARNED[0] in sides)  # their group's
        details[name] = {"prefill_ms": {p: prefill[p] for p in LEARNED}, **e["learned"]}
    name = f"every_policy_bytes_half_vs_full_at_{m}"
    ratios[name] = e["bytes"][e["worst_bytes"]]
    details[name] = {"worst": e["worst_bytes"], "per_policy": e["bytes"]}
    if e["replay"]:
        name, worst = f"replay_vs_full_prefill_at_{m}", max(e["replay"], key=e["replay"].__getitem__)
        ratios[name] = e["replay"][worst]
        details[name] = {"worst": worst, "per_policy": e["replay"]}
        if e.get("replay_floor"):  # the worst method's passes' forward alone: what its rule costs
            name = f"replay_floor_vs_full_prefill_at_{m}"
            details[name] = family_details(e["replay_floor"], [worst])
            ratios[name], ratios_cpu[name] = details[name]["per_policy"][worst], details[name]["cpu"][worst]
    for name, part in (
        (f"every_policy_half_vs_full_at_{m}", "decode"),
        (f"every_policy_prefill_vs_full_at_{m}", "prefill"),
        (f"every_policy_vs_floor_at_{m}", "floor"),
    ):
        ranked = [p for p in e["rounds"][part] if part != "prefill" or p not in e["replay"]]
        family = family_details(e["rounds"][part], ranked)
        ratios[name] = family["per_policy"][family["worst"]]
        ratios_cpu[name] = family["cpu"][family["worst_cpu"]]
        details[name] = family
    if e.get("column_sums_floor"):  # the column sums alone, in the group of the worst method reading them
        prefill = details[f"every_policy_prefill_vs_full_at_{m}"]["cpu"]
        worst = max(e["column_sums_floor"], key=prefill.__getitem__)
        name = f"column_sums_floor_vs_full_prefill_at_{m}"
        details[name] = family_details(e["column_sums_floor"], [worst])
        ratios[name], ratios_cpu[name] = details[name]["per_policy"][worst], details[name]["cpu"][worst]
    return ratios, ratios_cpu, details


def _policy_rows(
    model: LoadedModel,
    policies: list[PolicySpec],
    lengths: list[int],
    text: str,
    steps: int,
    budget: float,
    tick: Callable[[], None],
    on_row: Callable[[dict], None],
    done: Sequence[dict] = (),
) -> list[dict]:
    """The policy table: one run per policy and length, each row handed to `on_row` when measured; a row of
    `done` (a run cut short) is kept, not measured again."""
    kept = {(row["policy"], row["prompt_tokens"]): row for row in done}
    if len(kept) < len(policies) * len(lengths):
        # untimed warm-up: the process's first run pays one-off costs (allocator, kernels) that would land in
        # row one
        engine_once(model, PolicySpec("full"), prefix_ids(model, text, min(lengths), "The text"), 2, None)
    rows = []
    for n in lengths:
        ids = prefix_ids(model, text, n, "The text")
        for spec in policies:
            if (spec.label, n) in kept:
                rows.append(kept[spec.label, n])
            else:
                res = engine_once(model, spec, ids, steps, budget)
                res.pop("tokens")
                rows.append({"policy": spec.label, "prompt_tokens": n, "steps": steps, **res})
                on_row(rows[-1])
            tick()
    return rows


def length_part(n: int, e: dict, every: Sequence[str]) -> dict:
    """One evict length's ratios as `bench_speed`'s result names them, from its lockstep `e`: the evict ratio,
    and with `every` the every-policy ones in wall-clock and CPU time with their details; and `e` itself
    (`lockstep`), from which a resumed run rebuilds the result."""
    ratios, ratios_cpu, details = every_policy_ratios(e) if every else ({}, {}, {})
    return {
        "evict_length": n,
        "prompt_tokens": e["prompt_tokens"],
        "ratios": {f"evict_half_vs_full_at_{n}": e["ratio"], **ratios},
        "ratios_cpu": ratios_cpu,
        "ratio_details": details,
        "lockstep": e,
    }


def _speed_ratios(
    pairs: dict, evict: dict[int, dict], parts: list[dict], half: dict, whole: dict
) -> tuple[dict, dict, dict]:
    """The ratios in wall-clock time, in CPU time, and the details of the `every_policy_*` ones, from the
    engine's `pairs`, each evict length's `length_part` (the first length's lockstep in `evict` gives the
    prefill ratio) and a StreamingLLM run at half the budget (`half`) beside the full cache's (`whole`)."""
    ratios = {
        **{k: d["ratio"] for k, d in pairs.items()},
        "kv_bytes_half_budget_vs_full": half["kv_bytes_peak"] / whole["kv_bytes_prefill"],
    }
    if evict:
        ratios["prefill_stats_vs_full"] = next(iter(evict.values()))["prefill_ratio"]
    ratios_cpu = {k: d["cpu_ratio"] for k, d in pairs.items()}
    every_details: dict[str, dict] = {}
    for part in parts:
        ratios.update(part["ratios"])
        ratios_cpu.update(part["ratios_cpu"])
        every_details.update(part["ratio_details"])
    return ratios, ratios_cpu, every_details


def bench_speed(
    model: LoadedModel,
    policies: list[PolicySpec],
    lengths: list[int],
    *,
    text: str,
    steps: int,
    budget: float,
    repeats: int,
    ratio_length: int,
    evict_lengths: list[int],
    every: Sequence[str] = (),
    group: int = 0,
    tick: Callable[[], None] = lambda: None,
    on_row: Callable[[dict], None] = lambda row: None,
    on_length: Callable[[dict], None] = lambda part: None,
    done_rows: Sequence[dict] = (),
    done_lengths: Sequence[dict] = (),
) -> dict:
    """The policy table (one run per policy and length, each row handed to `on_row` when measured),
    the ratios at `ratio_length` and the evict ratios at each of `evict_lengths`, every policy of `every` in
    their lockstep (the `every_policy_*` ratios) in groups of `group` policies (`lockstep_groups`), each
    length's handed to `on_length` when measured (`length_part`: a run cut short keeps the lengths it
    finished).

    `done_rows` and `done_lengths`: what a run cut short with the same settings handed out (`kvlens bench
    speed --resume`), kept and not measured again. `tick` is called after every engine or loop run, or
    measurement kept (progress bars): `ticks(...)` gives the total.
    """
    if repeats < 1 or steps < 2:
        raise KvlensError("Speed needs at least one repeat and two generated tokens.")
    rows = _policy_rows(model, policies, lengths, text, steps, budget, tick, on_row, done_rows)
    finished = {part["evict_length"]: part for part in done_lengths}
    evict, parts = {}, []
    for n in evict_lengths:
        if n in finished:
            parts.append(finished[n])
            evict[n] = parts[-1]["lockstep"]
            for _ in range(length_ticks(n, repeats, every, group)):
                tick()
            continue
        evict[n] = evict_ratios(model, text, n, steps, 0.5, repeats, tick, list(every), group)
        parts.append(length_part(n, evict[n], every))
        on_length(parts[-1])
    ids = prefix_ids(model, text, ratio_length, "The text")
    pairs = engine_pairs(model, ids, steps, budget, repeats, tick)
    sl, full = PolicySpec("streaming_llm"), PolicySpec("full")
    half = engine_once(model, sl, ids, steps, 0.5)
    whole = engine_once(model, full, ids, steps, None)
    ratios, ratios_cpu, every_details = _speed_ratios(pairs, evict, parts, half, whole)
    return {
        "config": {
            "policies": [p.label for p in policies],
            "lengths": lengths,
            "steps": steps,
            "budget": budget,
            "repeats": repeats,
            "ratio_length": ratio_length,
            "evict_lengths": evict_lengths,
            "group": group,
        },
        "environment": environment(model),
        "rows": rows,
        "ratios": ratios,
        "ratios_cpu": ratios_cpu,
        "ratio_details": {
            **pairs,
            **{f"evict_half_vs_full_at_{n}": e for n, e in evict.items()},
            **every_details,
            "kv_bytes_half_budget_vs_full": {
                "half_bytes": half["kv_bytes_peak"],
                "full_prompt_bytes": whole["kv_bytes_prefill"],
                "slot_share": (half["kv_slots_max"] + 1) / ratio_length,
            },
        },
        "targets": verdicts(ratios, (half["kv_slots_max"] + 1) / ratio_length, ratios_cpu, every_details),
        "growth": growth(rows),
    }


def family_details(rounds: dict[str, dict[str, list[float]]], ranked: Sequence[str]) -> dict:
    """An every-policy ratio family from each policy's per-round ratios (`{"wall": [...], "cpu": [...]}`):
    the median per policy in wall-clock (`per_policy`) and CPU time (`cpu`), each with its [min, max] over
    the rounds (`spread`, `cpu_spread`), and the worst of `ranked` in each (`worst`, `worst_cpu`)."""
    out: dict = {"per_policy": {}, "spread": {}, "cpu": {}, "cpu_spread": {}}
    for name, measured in rounds.items():
        out["per_policy"][name] = median(measured["wall"])
        out["spread"][name] = [min(measured["wall"]), max(measured["wall"])]
        out["cpu"][name] = median(measured["cpu"])
        out["cpu_spread"][name] = [min(measured["cpu"]), max(measured["cpu"])]
    out["worst"] = max(ranked, key=out["per_policy"].__getitem__)
    out["worst_cpu"] = max(ranked, key=out["cpu"].__getitem__)
    return out


def verdicts(
    ratios: dict, slot_share: float, ratios_cpu: dict | None = None, details: dict | None = None
) -> dict:
    """Each measured ratio against its target (`TARGETS`): `{"target", "met"}`, in CPU time for the
    `CPU_TARGETS` families; bytes must match the slot share within 2% and stay at most 0.52 of the full
    prompt's. A ratio that misses where the rule of its method alone misses too names the method as the
    exception (`exception`: why, `rule_exception`)."""
    cpu = ratios_cpu or {}
    out = {}
    for k, t in TARGETS.items():
        judged = k.startswith(CPU_TARGETS) and k in cpu
        got = cpu[k] if judged else ratios.get(k)
        if got is not None:
            out[k] = {"target": f"<= {t}" + when(judged, f" {IN_CPU_TIME}"), "met": got <= t}
            why = rule_exception(k, t, ratios, cpu, details or {})
            if got > t and why:
                out[k]["exception"] = why
    got = ratios["kv_bytes_half_budget_vs_full"]
    out["kv_bytes_half_budget_vs_full"] = {
        "target": f"proportional ({slot_share:.3f}) and <= 0.52",
        "met": abs(got - slot_share) <= 0.02 * slot_share and got <= 0.52,
    }
    return out


def rule_exception(k: str, target: float, ratios: dict, cpu: dict, details: dict) -> str:
    """Why a missed ratio is its method's rule, or "": a replay ratio whose method's passes' forward alone
    (its replay floor) misses `target` too; a prefill ratio (CPU time) whose worst method reads column sums
    and whose H2O column sums alone in that method's group miss it too."""
    if k.startswith("replay_vs_"):
        floor = ratios.get("replay_floor" + k.removeprefix("replay"), 0.0)
        return f"its passes' forward alone takes {floor:.2f}x the full prefill" * (floor > target)
    if k.startswith("every_policy_prefill_vs_full_at_"):
        sums = "column_sums_floor_vs_full_prefill_at_" + k.rpartition("_")[2]
        worst = details.get(k, {}).get("worst_cpu")
        floor = cpu.get(sums, 0.0)
        reads = worst is not None and worst in details.get(sums, {}).get("cpu", {})
        why = f"its column sums alone take {floor:.2f}x the full prefill in CPU time"
        return why * (reads and floor > target)
    return ""


def growth(rows: list[dict]) -> dict:
    """Per policy, least-squares slopes over prompt length: decode and prefill ms per 1000 prompt tokens."""
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        if len({r["prompt_tokens"] for r in mine}) < 2:
            continue
        out[policy] = {
            "ms_per_token_per_1k_prompt": _slope(mine, "ms_per_token") * 1000,
            "prefill_ms_per_1k_prompt": _slope(mine, "prefill_ms") * 1000,
            "prefill_ms_by_length": {r["prompt_tokens"]: r["prefill_ms"] for r in mine},
            "ms_per_token_by_length": {r["prompt_tokens"]: r["ms_per_token"] for r in mine},
        }
    return out


def _slope(rows: list[dict], key: str) -> float:
    xs = [r["prompt_tokens"] for r in rows]
    ys = [r[key] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def markdown_table(result: dict) -> str:
    """Policy x prompt length: prefill ms, ms/token (wall and CPU), KV MiB, peak RSS MiB."""
    lines = [
        "| policy | prompt | prefill ms | ms/token | CPU ms/token | KV MiB (peak) | process RSS MiB (peak) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['prompt_tokens']} | {r['prefill_ms']:.0f} | {r['ms_per_token']:.1f} | "
            f"{r['cpu_ms_per_token']:.1f} | "
            f"{r['kv_bytes_peak'] / 2**20:.2f} | {r['peak_rss'] / 2**20:.0f} |"
        )
    return "\n".join(lines)
