"""Task accuracy under compression: RULER-style samples, the field's compress-once protocol, a leaderboard.

Protocol (kvpress's `evaluation/`, question-agnostic by default): the chat template's user turn is the
sample's context then its question; the context's tokens are compressed once to `int(len * (1 - ratio))` slots
per KV head and layer (kvpress's compression ratio, the share removed, and its rounding; `rounding=kvlens`:
`len - int(len * ratio)`, the results made before the option), then the question is appended uncompressed and
the answer generated greedily (`kvlens.engine.shared_prefill`). Several questions of one sample
(`niah_multiquery`) are asked one after the other of the same compressed context, each from it afresh.
`query_aware` compresses context and question together (SnapKV's setting), one prefill per question.

A cell of the grid is one sample with every policy and ratio: its context is prefilled once and shared
(`SharedPrefill`); each (policy, ratio) then costs its restore and compression (`prepare_ms`), its share of
the method's own passes (`own_ms`: KVzip's replay of the prompt, run once for all its ratios, which is the
method) and its answers (`answer_ms`). The summary's `cost_vs_answer` is (compression + answers) / answers,
the method's own passes reported beside it (`own_vs_answer`). Scores are RULER's string match
(`kvlens.experiments.bench.ruler.score`); a generated sample's needles sit at stratified depths (`depths`,
`ruler.generate`), each row records them (`needle_depths`), and `needle_grid` scores each needle found by
depth and length (the field's needle-in-a-haystack figure, `needle_figure`). A cell's optional `storage`
(`Storage.describe()`) quantizes every policy's compressed context and what follows (the bytes-quality
frontier, `kvlens.experiments.bench.frontier`); each result reports the compressed context's physical
`kv_bytes`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from kvlens.engine.batch_answer import Kept, answer_many
from kvlens.engine.loop import RunOptions
from kvlens.engine.models import LoadedModel
from kvlens.engine.shared_prefill import (
    QUIET,
    ROUNDINGS,
    SharedPrefill,
    answer,
    prepare,
    slots_for,
    split_prompt,
    template_parts,
)
from kvlens.errors import KvlensError
from kvlens.experiments.bench import kvpress_metrics, ruler
from kvlens.experiments.bench.common import PolicySpec, bootstrap
from kvlens.experiments.grid import digest
from kvlens.kvcache.quantize import Storage
from kvlens.policies import make_policy, resolve_budget

ANSWER_BATCH_BYTES = (
    1 << 30
)  # a batch's slots, each cache padded to the longest: about this at most (plus one cache)


def context_token_spans(
    model: LoadedModel, context: str, spans: list[tuple[int, int]], chat: bool = True
) -> list[tuple[int, int]]:
    """Character spans of `context` -> the token spans `[start, end)` that cover them in `split_prompt`'s
    context ids (the tokens overlapping each span)."""
    head, _ = template_parts(model, chat)
    offsets = model.tokenizer(
        head + context, add_special_tokens=not chat, return_offsets_mapping=True
    ).offset_mapping
    out = []
    for start, end in spans:
        inside = [i for i, (a, b) in enumerate(offsets) if a < end + len(head) and b > start + len(head)]
        if inside:
            out.append((inside[0], inside[-1] + 1))
    return out


def _policy_major(specs: list[PolicySpec], ratios: list[float]) -> list[tuple[PolicySpec, float | None]]:
    """Every (policy, ratio) of a cell, a budget-free policy once (ratio None), policy by policy."""
    return [
        (spec, ratio)
        for spec in specs
        for ratio in ([None] if make_policy(spec.name, dict(spec.params)).budget_free else ratios)
    ]


def _ratio_major(pairs: list[tuple[PolicySpec, float | None]]) -> list[tuple[PolicySpec, float | None]]:
    """The same pairs, the budget-free ones first, then by ratio, least compressed first: caches of one batch
    keep about as many slots (a batch pads every cache to its longest)."""
    return sorted(pairs, key=lambda pair: -1 if pair[1] is None else pair[1])


def sample_of(model: LoadedModel, texts: dict[str, str], cell: dict) -> ruler.Sample:
    """The cell's sample: line `index` of the user's file, or generated from the seed (a cell without `depths`
    was planned before the option: random depths)."""
    if "samples" in texts:
        return ruler.parse_lines(texts["samples"])[cell["index"]]
    return ruler.generate(
        cell["suite_task"],
        cell["length"],
        cell["index"],
        lambda s: len(model.tokenizer(s, add_special_tokens=False).input_ids),
        texts["haystack"],
        seed=cell["seed"],
        depths=cell.get("depths") or ruler.IMPLIED["depths"],
        count=cell.get("count", 1),
    )


def _prompts(
    cell: dict, parts: list[tuple[list[int], list[int]]]
) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """The prompts prefilled, each with the questions it asks (indices into `parts`, each question's context
    and question ids) and the ids appended after it for each: the context once, every question appended after
    it, or (query-aware) context and question together, one prompt per question, nothing appended."""
    if cell["query_aware"]:
        return [(c + q, [i], [[]]) for i, (c, q) in enumerate(parts)]
    return [(parts[0][0], list(range(len(parts))), [q for _, q in parts])]


def _budget(policy, ratio: float | None, prompt: int, extra: int, rounding: str) -> int | None:
    """The budget keeping a `prompt`-token context compressed at `ratio` (`slots_for`), `extra` tokens to
    come; None for a budget-free policy (ratio None)."""
    if ratio is None:
        return None
    return resolve_budget(policy, slots_for(ratio, prompt, rounding), prompt, prompt + extra)


def _prepare_pairs(
    model: LoadedModel,
    cell: dict,
    pairs: list[tuple[PolicySpec, float | None]],
    runs: dict[tuple, dict],
    prompt: list[int],
    extra: int,
    shared: SharedPrefill,
    batch: _Batch,
    opts: RunOptions,
) -> None:
    """Every (policy, ratio) of `pairs`, ratio by ratio (`_ratio_major`), prepared from the `shared` prefill
    of `prompt` and handed to `batch`; its costs, kept share and bytes added to its entry of `runs`. A
    policy's replay passes (KVzip) run for its first ratio; each of its ratios counts a share of them."""
    replay_ms: dict[str, float] = {}
    for spec, ratio in _ratio_major(pairs):
        policy = make_policy(spec.name, dict(spec.params))
        share = 1 if ratio is None else len(cell["ratios"])
        rounding = cell.get("rounding", ruler.IMPLIED["rounding"])
        budget = _budget(policy, ratio, len(prompt), extra, rounding)
        out = runs[(spec.label, ratio)]
        t = time.perf_counter()
        loop, logits = prepare(model, policy, prompt, budget, extra, shared, opts)
        replay_ms[spec.label] = replay_ms.get(spec.label) or loop.replay_ms
        out["prepare_ms"] += (time.perf_counter() - t) * 1000 - loop.replay_ms
        out["own_ms"] += replay_ms[spec.label] / share
        out["kept"].append(loop.kept[0].float().mean().item() / len(prompt))
        out["bytes"].append(loop.cache.nbytes)
        batch.add(out, loop, logits)


def _results(runs: dict[tuple, dict], sample: ruler.Sample, questions: int) -> list[dict]:
    """One result per (policy, ratio) of `runs`: its score over the `questions` answers, the answers, the
    kept share and bytes, NLL and costs."""
    results = []
    for (label, ratio), out in runs.items():
        outputs = [out["outputs"][i] for i in range(questions)]
        results.append(
            {
                "policy": label,
                "ratio": 0.0 if label == "full" else ratio,
                "score": kvpress_metrics.score_sample(outputs, sample),
                "outputs": outputs,
                "kept_share": statistics.fmean(out["kept"]),
                "kv_bytes": statistics.fmean(out["bytes"]),
                "nll": statistics.fmean(out["nlls"]),
                "prepare_ms": out["prepare_ms"],
                "own_ms": out["own_ms"],
                "answer_ms": out["answer_ms"],
            }
        )
    return results


def tasks_cell(model: LoadedModel, texts: dict[str, str], cell: dict) -> dict:
    """One sample under every policy and ratio of the cell: `{"prompt_tokens", "shared_prefill_ms",
    "results"}`, a result per (policy, ratio) with its score, answers and costs."""
    sample = sample_of(model, texts, cell)
    specs = [PolicySpec.parse(s) for s in cell["policies"]]
    parts = [
        split_prompt(model, sample.context, q, cell["chat"], sample.answer_prefix) for q in sample.questions
    ]
    opts = dataclasses.replace(QUIET, storage=Storage.of(cell.get("storage")))
    pairs = _policy_major(specs, cell["ratios"])
    runs = {
        (spec.label, ratio): {
            "outputs": {},
            "nlls": [],
            "prepare_ms": 0.0,
            "own_ms": 0.0,
            "answer_ms": 0.0,
            "kept": [],
            "bytes": [],
        }
        for spec, ratio in pairs
    }
    shared_ms = 0.0
    for prompt, asked, questions in _prompts(cell, parts):
        extra = max(len(q) for q in questions) + sample.max_new_tokens
        shared = SharedPrefill(model, prompt, [make_policy(s.name, dict(s.params)) for s in specs])
        shared_ms += shared.ms
        batch = _Batch(
            model,
            sample,
            prompt,
            asked,
            questions,
            cell.get("stop_when_found", True) and sample.kvpress is None,  # kvpress's metrics read it all
            batched=cell.get("batch", True) and not opts.storage.packed,
        )
        _prepare_pairs(model, cell, pairs, runs, prompt, extra, shared, batch, opts)
        batch.flush()
    depths = None if sample.depths is None else [list(d) for d in sample.depths]
    return {
        "prompt_tokens": len(parts[0][0]),
        "answers": [list(a) for a in sample.answers],
        "needle_depths": depths,
        "shared_prefill_ms": shared_ms,
        "results": _results(runs, sample, len(parts)),
    }


class _Batch:
    """Prepared (policy, ratio) caches of one prompt, answered together (`answer_many`) once the batch, each
    cache padded to the longest, holds `ANSWER_BATCH_BYTES`, or one by one (`batched=False`: quantized
    storage, whose appended tokens the batch would not quantize). A result's `answer_ms` is its share of the
    batch's time, by tokens generated. `stop`: a row stops once every expected string of its question is in
    its answer (the score, a share of strings found, cannot change after that; False: always RULER's
    answer-length limit)."""

    def __init__(self, model, sample, prompt, asked, questions, stop: bool, batched: bool):
        self.model, self.sample, self.start, self.asked, self.questions = (
            model,
            sample,
            len(prompt),
            asked,
            questions,
        )
        self.stop, self.batched = stop, batched
        self.pending: list[tuple[dict, object, object]] = []

    def add(self, out: dict, loop, logits) -> None:
        """A prepared cache; batched, only its kept slots stay (`Kept`) and the loop is dropped."""
        self.pending.append((out, Kept(loop) if self.batched else loop, logits))
        if (
            not self.batched
            or len(self.pending) * max(k.nbytes for _, k, _ in self.pending) >= ANSWER_BATCH_BYTES
        ):
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        decode = self.model.tokenizer.decode
        for turn, (i, question) in enumerate(zip(self.asked, self.questions, strict=True)):
            expected = [e.lower() for e in self.sample.answers[i]]

            def done(_row, tokens, expected=expected):
                return self.stop and all(
                    e in decode(tokens, skip_special_tokens=True).lower() for e in expected
                )

            t = time.perf_counter()
            if self.batched:
                answers = answer_many(
                    [kept for _, kept, _ in pending],
                    question,
                    self.start,
                    self.sample.max_new_tokens,
                    [lg for _, _, lg in pending],  # answered from when no question is appended
                    done,
                    release=turn == len(self.asked) - 1,
                )
            else:
                answers = []
                for _, loop, logits in pending:
                    mark = loop.cache.mark()
                    answers.append(
                        answer(
                            loop,
                            question,
                            self.start,
                            self.sample.max_new_tokens,
                            logits,  # answered from when no question is appended
                            lambda tokens: done(0, tokens),
                        )
                    )
                    loop.cache.rewind(mark)
            elapsed = (time.perf_counter() - t) * 1000
            total = sum(len(tokens) for tokens, _ in answers)
            for (out, _, _), (tokens, nlls) in zip(pending, answers, strict=True):
                out["answer_ms"] += elapsed * len(tokens) / total
                out["outputs"][i] = decode(tokens, skip_special_tokens=True)
                out["nlls"].extend(nlls)


def plan_tasks(
    policies: list[PolicySpec],
    ratios: list[float],
    tasks: list[str],
    lengths: list[int],
    count: int,
    *,
    model: str,
    seed: int,
    query_aware: bool,
    chat: bool,
    source: str,
    generated: bool = True,
    stop_when_found: bool = True,
    batch: bool = True,
    rounding: str = "kvpress",
    depths: str = "stratified",
) -> list[dict]:
    """The grid's cells: one per sample (task x length x index), each with every policy and ratio;
    `source` is the digest of the haystack or of the user's samples file (not `generated`:
    `tasks`/`lengths` are the file's). `stop_when_found` and `batch`: how answers are generated
    (`_Batch`); `rounding`: a ratio's kept count (`slots_for`); `depths`: where generated needles sit
    (`ruler.generate`, over the `count` samples)."""
    bad = [r for r in ratios if not 0 < r < 1]
    if bad:
        raise KvlensError(
            f"A compression ratio is the share of the context removed, in (0, 1); got {bad[0]}."
        )
    if rounding not in ROUNDINGS:
        raise KvlensError(f"Unknown rounding '{rounding}'; the roundings are {', '.join(ROUNDINGS)}.")
    if depths not in ruler.DEPTHS:
        raise KvlensError(f"Unknown needle depths '{depths}'; they are {', '.join(ruler.DEPTHS)}.")
    if not any(p.name == "full" for p in policies):
        policies = [PolicySpec("full"), *policies]  # every leaderboard cell is read against the full cache
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if unknown and generated:
        raise KvlensError(f"Unknown task '{unknown[0]}'; the tasks are {', '.join(ruler.TASKS)}.")
    return [
        {
            "task": "tasks",
            "model": model,
            "suite_task": task,
            "length": length,
            "index": i,
            "seed": seed,
            "policies": [p.label for p in policies],
            "ratios": ratios,
            "query_aware": query_aware,
            "chat": chat,
            "stop_when_found": stop_when_found,
            "batch": batch,
            "source": source,
            "rounding": rounding,
            **_depths(generated, depths, count),
        }
        for task in tasks
        for length in lengths
        for i in range(count)
    ]


def _depths(generated: bool, depths: str, count: int) -> dict:
    """A generated cell's depths and, when they are stratified, the count they spread over (a file's:
    nothing)."""
    if not generated:
        return {}
    return {"depths": depths, "count": count} if depths == "stratified" else {"depths": depths}


def plan_file(
    samples: list[ruler.Sample],
    policies,
    ratios,
    *,
    model: str,
    query_aware: bool,
    chat: bool,
    text: str,
    **answers,
) -> list[dict]:
    """Cells for a user's samples: one per line, the line's index naming it (`answers`: as `plan_tasks`)."""
    cells = []
    for i, s in enumerate(samples):
        cells += plan_tasks(
            policies,
            ratios,
            [s.task],
            [None],
            1,
            model=model,
            seed=0,
            query_aware=query_aware,
            chat=chat,
            source=digest(text),
            generated=False,
            **answers,
        )
        cells[-1]["index"] = i
    return cells


def flatten(rows: list[dict]) -> list[dict]:
    """One record per (sample, policy, ratio), from the cells' rows."""
    return [
        {
            "task": r["suite_task"],
            "length": r["length"],
            "index": r["index"],
            **res,
            "answers": r.get("answers"),
            "needle_depths": r.get("needle_depths"),
            "shared_prefill_ms": r["shared_prefill_ms"],
            "cell_ms": r["shared_prefill_ms"] / len(r["results"])
            + res["prepare_ms"]
            + res.get("own_ms", 0.0)
            + res["answer_ms"],
        }
        for r in rows
        for res in r["results"]
    ]


def turns(records: list[dict]) -> list[dict] | None:
    """Each question in turn (question 1, 2, ...) over `records` whose samples ask several of one compressed
    context (niah_multiquery: does a question-agnostic cache degrade as questions go on?): its mean score and
    bootstrap 95 % interval over the samples; None when a record asks one question, the records ask different
    numbers, or a row does not keep its outputs and expected answers."""
    if any(r.get("outputs") is None or r.get("answers") is None for r in records):
        return None
    counts = {len(r["outputs"]) for r in records}
    if len(counts) != 1 or counts == {1}:
        return None
    out = []
    for k in range(counts.pop()):
        scores = [ruler.score(r["outputs"][k], r["answers"][k]) for r in records]
        low, high = bootstrap([scores])
        out.append({"score": statistics.fmean(scores), "ci_low": low, "ci_high": high})
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Leaderboard cells: per (policy, ratio, task, length), averaged over tasks ("all") at each length and
    over both ("all", "all"), the mean score, the samples, a bootstrap 95 % interval, the full cache's score
    on the same samples, the costs and, for a task that asks several questions of one context, each turn's
    score (`turns`)."""
    records = flatten(rows)
    cells: dict[tuple, dict[tuple, list[float]]] = {}
    members: dict[tuple, list[dict]] = {}  # each cell's records, gathered in the same pass
    for r in records:
        for task, length in [(r["task"], r["length"]), ("all", r["length"]), ("all", "all")]:
            key = (r["policy"], r["ratio"], task, length)
            cells.setdefault(key, {}).setdefault((r["task"], r["length"]), []).append(r["score"])
            members.setdefault(key, []).append(r)
    full = {
        key[2:]: statistics.fmean(statistics.fmean(g) for g in groups.values())
        for key, groups in cells.items()
        if key[0] == "full"
    }
    out = []
    for (policy, ratio, task, length), groups in cells.items():
        low, high = bootstrap(list(groups.values()))
        mine = members[(policy, ratio, task, length)]
        out.append(
            {
                "policy": policy,
                "ratio": ratio,
                "task": task,
                "length": length,
                "score": statistics.fmean(statistics.fmean(g) for g in groups.values()),
                "ci_low": low,
                "ci_high": high,
                "samples": sum(len(g) for g in groups.values()),
                "full_score": full.get((task, length)),
                "kept_share": statistics.fmean(r["kept_share"] for r in mine),
                "cost_vs_answer": statistics.median(
                    (r["prepare_ms"] + r["answer_ms"]) / r["answer_ms"] for r in mine
                ),
                "own_vs_answer": statistics.median(r.get("own_ms", 0.0) / r["answer_ms"] for r in mine),
                "cell_ms": statistics.median(r["cell_ms"] for r in mine),
                "turns": None if task == "all" else turns(mine),
            }
        )
    return sorted(
        out,
        key=lambda s: (s["task"] != "all", str(s["task"]), str(s["length"]), s["ratio"] or 0, -s["score"]),
    )


def table(summary: list[dict]) -> str:
    """The averaged leaderboard as a terminal table: a row per policy, a column per ratio; a budget-free
    policy (ratio None: it keeps what its own rule keeps) has its score in a column of its own, with its kept
    share."""
    avg = [s for s in summary if s["task"] == s["length"] == "all"]
    ratios = sorted({s["ratio"] for s in avg if s["policy"] != "full" and s["ratio"] is not None})
    full = next((s for s in avg if s["policy"] == "full"), None)
    lines = [f"{'policy':<24}" + "".join(f"{f'r={r:g}':>20}" for r in ratios) + f"{'own budget':>20}"]
    if full:
        lines.append(f"{'full (r=0)':<24}{_scored(full)}")
    for policy in dict.fromkeys(s["policy"] for s in avg if s["policy"] != "full"):
        by = {s["ratio"]: s for s in avg if s["policy"] == policy}
        own = by.get(None)
        lines.append(
            f"{policy:<24}"
            + "".join(_scored(by.get(r)).rjust(20) for r in ratios)
            + _scored(own, " keeps {kept_share:.0%}")
        )
    return "\n".join(lines)


def _scored(s: dict | None, tail: str = "") -> str:
    """A summary cell's score and 95 % interval, then `tail` (formatted with the cell); "" without one."""
    return f"{s['score']:>8.1%} [{s['ci_low']:.0%}, {s['ci_high']:.0%}]{tail.format(**s)}" if s else ""


def protocol(config: dict) -> str:
    """How a grid with this `config` compressed: "query-aware" (`--query-aware`) or "question-agnostic"."""
    return "query-aware" if config.get("query_aware") else "question-agnostic"


def _panel_points(summary: list[dict], policy: str, panel: str) -> tuple[dict[float, list[dict]], bool]:
    """`policy`'s summary cells in one panel by compression ratio (the "all" panel: those over all lengths), a
    budget-free policy's at the share its own rule removed (1 - kept share); and whether it is budget-free."""
    pts: dict = {}
    for s in summary:
        if s["policy"] == policy and s["task"] == panel and (panel != "all" or s["length"] == "all"):
            pts.setdefault(s["ratio"], []).append(s)
    free = pts.pop(None, None)  # a budget-free policy: at the share it removed
    if free:
        pts[round(1 - statistics.fmean(s["kept_share"] for s in free), 4)] = free
    return pts, bool(free)


def _policy_line(policy: str, i: int, policies: int, pts: dict[float, list[dict]], free: bool, legend: bool):
    """One policy's line in a panel: the mean score at each ratio of `pts` with its mean 95 % interval,
    points set apart by the policy's index `i` of `policies` (the full cache's not); styled by `i` (10
    colours, then again dotted with squares), the full cache a star, a budget-free policy a diamond."""
    import plotly.colors
    import plotly.graph_objects as go

    palette = plotly.colors.qualitative.T10  # 10 colours, then again dotted with squares: 20 distinct styles
    xs = sorted(pts)
    ys = [statistics.fmean(s["score"] for s in pts[x]) for x in xs]
    lo = [y - statistics.fmean(s["ci_low"] for s in pts[x]) for x, y in zip(xs, ys, strict=True)]
    hi = [statistics.fmean(s["ci_high"] for s in pts[x]) - y for x, y in zip(xs, ys, strict=True)]
    again = i // len(palette) % 2  # the second round of colours
    mode, symbol, size = "lines+markers", ("circle", "square")[again], 6
    if free:
        mode, symbol, size = "markers", "diamond", 11
    if policy == "full":
        mode, symbol, size = "markers", "star", 11
    dodge = 0.08 * (i / max(1, policies - 1) - 0.5)  # ties stay visible side by side
    return go.Scatter(
        x=[x + dodge * (policy != "full") for x in xs],
        y=ys,
        mode=mode,
        name=policy,
        legendgroup=policy,
        showlegend=legend,
        line={
            "color": palette[i % len(palette)],
            "dash": ("solid", "dot")[again],
        },
        marker={"symbol": symbol, "size": size},
        error_y={
            "type": "data",
            "symmetric": False,
            "array": hi,
            "arrayminus": lo,
            "thickness": 1,
        },
    )


def figure(result: dict):
    """Score against compression ratio, one line per method (kvpress's leaderboard plot): averaged over tasks,
    then one panel per task; bars are bootstrap 95 % intervals over samples, points of one ratio are set
    slightly apart so that ties stay visible; the full cache is the star at ratio 0, a budget-free policy a
    diamond at the share its own rule removed (1 - kept share)."""
    from plotly.subplots import make_subplots

    import kvlens.figures.plots  # noqa: F401  registers the "kvlens" paper template

    summary = result["summary"]
    panels = ["all", *sorted({s["task"] for s in summary if s["task"] != "all"})]
    grid_rows = 1 + (len(panels) > 3)
    grid_cols = -(-len(panels) // grid_rows)
    fig = make_subplots(
        rows=grid_rows,
        cols=grid_cols,
        shared_yaxes=True,
        horizontal_spacing=0.04,
        vertical_spacing=0.16,
        subplot_titles=[{"all": "average over tasks"}.get(p, p) for p in panels],
    )
    policies = list(dict.fromkeys(s["policy"] for s in summary))
    for n, panel in enumerate(panels):
        row, col = divmod(n, grid_cols)
        row, col = row + 1, col + 1
        for i, policy in enumerate(policies):
            pts, free = _panel_points(summary, policy, panel)
            if pts:
                fig.add_trace(_policy_line(policy, i, len(policies), pts, free, n == 0), row, col)
        fig.update_xaxes(
            title_text="compression ratio (share removed)" if (row, col) == (grid_rows, 1) else None,
            range=[-0.06, 0.98],
            row=row,
            col=col,
        )
    fig.update_yaxes(range=[-0.02, 1.02])
    for row in range(1, grid_rows + 1):
        fig.update_yaxes(title_text="score (share found)", row=row, col=1)
    fig.update_layout(
        title=f"Task accuracy under compression ({protocol(result.get('config', {}))}, "
        f"{result.get('environment', {}).get('model', 'model')})",
        width=max(800, 330 * grid_cols + 220),
        height=max(380 * grid_rows + 120, 26 * len(policies) + 160),
        legend={"tracegroupgap": 0},
        template="kvlens",
    )
    return fig
