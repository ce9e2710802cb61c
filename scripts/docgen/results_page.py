"""docs/results.md and the README's results summary: every table from a file in `results/`, with the command,
date and machine the file records and the spread of each number."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from docgen.common import ROOT, banner, table

NBSP, JOIN = "\u00a0", "\u2060"  # no-break space, word joiner: a narrow table column never splits a value


def spread(value: str, low: str, high: str) -> str:
    return f"{value}{NBSP}[{low}{JOIN}–{JOIN}{high}]"


RESULTS = ROOT / "results"
QUERY_AWARE = "bench_tasks_query_aware.json"
# The files the pages cite, in the order of the app's Benchmarks page, each with its section title.
CITED = {
    "bench_tasks.json": "Task accuracy under compression",
    "bench_frontier.json": "Quality at equal bytes: eviction, merging, quantized and low-rank storage",
    "bench_speed.json": "Speed and memory",
    QUERY_AWARE: "Task accuracy under compression, query-aware",
    "decode_phases.json": "Where a decode step goes: what each method costs beyond an eviction",
    "bench_ppl.json": "Perplexity of the eviction and merging policies",
    "bench_needle.json": "Needle in a haystack",
    "sweep_cam_perturbation.json": "CaM: output perturbation against the budget",
    "explain.json": "Why a compressed cache gets a needle wrong: the smallest sufficient restore",
}
# a grid that takes hours of its own, cited once its file is there (`kvlens bench tasks --query-aware`)
OPTIONAL = {QUERY_AWARE}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def f3(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def machine(env: dict | None) -> str:
    if not env:
        return "not recorded in the file"
    parts = [
        f"{env.get('cpus')}-core {env.get('machine')} CPU"
        if env.get("device", "cpu") == "cpu"
        else str(env.get("device")),
        f"torch {env.get('torch')}",
        env.get("dtype", "float32"),
    ]
    if env.get("executor"):
        parts.append(str(env["executor"]))
    elif env.get("threads"):
        parts.append(f"{env['threads']} threads")
    return ", ".join(parts)


def provenance(name: str, obj: dict) -> str:
    """Command, date and machine of a results file, as the lines that open its section."""
    env = obj.get("environment")
    when = (
        f"{env['time'][:10]} · {machine(env)}"
        if env and env.get("time")
        else "date and machine not recorded in the file"
    )
    out = f"`results/{name}` · made by `{obj.get('command', 'not recorded')}` · {when}"
    model = (env or {}).get("model") or obj.get("model")
    if model:
        out += f" · model `{model}`"
    done, total = obj.get("cells_done"), obj.get("cells_total")
    if isinstance(done, int) and isinstance(total, int) and done < total:
        out += f" · **{done} of {total} cells done** (the grid is not finished; rows so far)"
    return out + ".\n\n"


def finished(obj: dict) -> list[dict]:
    """A task grid's finished samples (the rows holding their results)."""
    return [r for r in obj["rows"] if isinstance(r.get("results"), list)]


def cells_left(obj: dict) -> str:
    """ "; D of T cells done" for a grid that is not finished, else nothing."""
    done, total = obj.get("cells_done"), obj.get("cells_total")
    unfinished = isinstance(done, int) and isinstance(total, int) and done < total
    return f"; {done} of {total} cells done" if unfinished else ""


def summary_of(obj: dict) -> list[dict]:
    """A task grid's leaderboard cells: the file's own summary (what the benchmark wrote with its rows), or
    one computed from its rows if it has none."""
    summary = obj.get("summary")
    if isinstance(summary, list):
        return summary
    from kvlens.experiments.bench import tasks

    return tasks.summarise(finished(obj))


def task_summary(obj: dict) -> list[dict]:
    """The leaderboard cells averaged over tasks and lengths (`summary_of`)."""
    return [s for s in summary_of(obj) if s["task"] == "all" and s["length"] == "all"]


# how a task grid compresses (`kvlens bench tasks [--query-aware]`), one file per protocol
PROTOCOL = {
    False: "question-agnostic: the context is compressed once to the ratio (the share removed,"
    " as in kvpress), then each question is asked of that cache.",
    True: "query-aware (`--query-aware`, SnapKV's setting): the context and one question are compressed "
    "together to the ratio, and that question is answered.",
}


def tasks_section(obj: dict) -> str:
    cfg = obj["config"]
    rows = finished(obj)
    elsewhere = sorted({r["machine"] for r in rows if r.get("machine")})
    out = (
        f"Tasks {', '.join(f'`{t}`' for t in cfg['tasks'])} at context lengths "
        f"{', '.join(map(str, cfg['lengths']))} tokens, {cfg['count']} samples each; "
        + PROTOCOL[bool(cfg.get("query_aware"))]
        + " Score: the share of "
        "the expected strings found in the answers, averaged over tasks and lengths; in brackets "
        "the bootstrap "
        "95 % interval over samples. " + conventions(cfg)
    )
    if elsewhere:
        n = sum(1 for r in rows if r.get("machine"))
        out += f" {n} of the {len(rows)} samples ran on another machine ({'; '.join(elsewhere)})."
    out += grid_time(rows) + "\n\n"
    summary = task_summary(obj)
    ratios = sorted({s["ratio"] for s in summary if s["ratio"]})
    by = {(s["policy"], s["ratio"]): s for s in summary}
    names = list(dict.fromkeys(s["policy"] for s in summary))
    key = {n: -(by.get((n, 0.5)) or by.get((n, None)) or by.get((n, 0.0)))["score"] for n in names}
    body = []
    for n in sorted(names, key=lambda n: key[n]):

        def fmt(s):
            return (
                "" if s is None else spread(f"{s['score']:.3f}", f"{s['ci_low']:.3f}", f"{s['ci_high']:.3f}")
            )

        own = by.get((n, None)) or by.get((n, 0.0))
        body.append(
            [
                f"`{n}`",
                *(fmt(by.get((n, r))) for r in ratios),
                fmt(own),
                str((own or by[(n, ratios[0])])["samples"]),
            ]
        )
    out += table(["policy", *(f"ratio {r}" for r in ratios), "full or budget-free", "samples"], body)
    out += (
        "\nSorted by the score at ratio 0.5. The full cache and the budget-free policies (which decide their "
        "own size) have no ratio. The app's Benchmarks page shows each task and length.\n\n"
    )
    return out + ("" if cfg.get("query_aware") else turns_table(summary_of(obj)))


def sample_minutes(rows: list[dict]) -> dict[tuple, tuple[float, int]]:
    """(task, length) -> (its median sample's minutes, its samples) over the rows run on the file's machine:
    a sample's minutes are its policies' and ratios' `cell_ms`, and the median keeps a sample timed across a
    pause of its worker from counting."""
    from kvlens.experiments.bench.tasks import flatten

    samples: dict[tuple, float] = {}  # (task, length, index) -> minutes
    for record in flatten([r for r in rows if not r.get("machine")]):
        key = (record["task"], record["length"], record["index"])
        samples[key] = samples.get(key, 0.0) + record["cell_ms"] / 60_000
    times: dict[tuple, list[float]] = {}
    for (task, length, _), minutes in samples.items():
        times.setdefault((task, length), []).append(minutes)
    return {key: (statistics.median(v), len(v)) for key, v in times.items()}


def worker_hours(minutes: dict[tuple, tuple[float, int]], lengths: set | None = None) -> float:
    """One worker's hours for the (task, length) groups of `sample_minutes`, only `lengths` when given."""
    return sum(m * n for (_, length), (m, n) in minutes.items() if lengths is None or length in lengths) / 60


def grid_time(rows: list[dict]) -> str:
    """How long the grid's samples took on the file's machine (rows run elsewhere aside; `sample_minutes`),
    and the cheapest and dearest task and length; empty without such rows."""
    minutes = sample_minutes(rows)
    if not minutes:
        return ""
    (cheap, short), (dear, long) = (f(minutes, key=lambda k: minutes[k][0]) for f in (min, max))
    least, most = minutes[(cheap, short)][0], minutes[(dear, long)][0]
    return (
        f" Its samples took {worker_hours(minutes):.1f} h of one worker's time on this machine (each task "
        f"and length: its median sample's minutes times its samples), from {least:.1f} min a sample "
        f"(`{cheap}`, {short} tokens) to {most:.1f} min (`{dear}`, {long} tokens)."
    )


def turns_table(summary: list[dict], ratio: float = 0.5) -> str:
    """niah_multiquery question by question: the full cache's score on each turn, and the compressed policies'
    at `ratio` as their mean difference from the full cache on the same turn (a question-agnostic cache that
    degrades as questions go on loses more on later turns); empty without per-turn scores."""
    cells = [s for s in summary if s.get("turns") and s["task"] != "all"]
    full = {s["length"]: s["turns"] for s in cells if s["policy"] == "full"}
    body = []
    for length, reference in sorted(full.items()):
        others = [s["turns"] for s in cells if s["length"] == length and s["ratio"] == ratio]
        if not others:
            continue
        gaps = [statistics.fmean(t[k]["score"] for t in others) - f["score"] for k, f in enumerate(reference)]
        body.append(
            [
                length,
                " · ".join(f"{f['score']:.2f}" for f in reference),
                " · ".join(f"{g:+.2f}" for g in gaps),
                len(others),
            ]
        )
    if not body:
        return ""
    return (
        "`niah_multiquery` asks its four questions one after the other of one compressed context. Per turn "
        "(question 1 · 2 · 3 · 4, the needles in shuffled order), the full cache's score and, at ratio "
        f"{ratio}, "
        "the policies' mean difference from it on the same turn; each policy's turns are on the app's "
        "Benchmarks page:\n\n"
        + table(["tokens", "full cache", f"policies at ratio {ratio} − full", "policies"], body)
        + "\n"
    )


def needles_figure(cfg: dict) -> str:
    """The needle figure `kvlens bench tasks` writes beside the grid's file (`<file stem>_needles.png`)."""
    return f"results/{Path(QUERY_AWARE if cfg.get('query_aware') else 'bench_tasks.json').stem}_needles.png"


def conventions(cfg: dict) -> str:
    """How the file counted a ratio's slots and placed its needles (a file from before the options: kvlens's
    rounding, random depths), and the options that resume it."""
    from kvlens.experiments.bench import task_needles

    rounding, depths = cfg.get("rounding", "kvlens"), cfg.get("depths", "random")
    kept = (
        "int(T × (1 − ratio)), kvpress's"
        if rounding == "kvpress"
        else "T − int(T × ratio) (kvlens's rounding before `--rounding`)"
    )
    where = (
        "spread evenly over the samples (stratified)"
        if depths == "stratified"
        else "at uniformly random sentence boundaries (RULER's)"
    )
    return (
        f"A context of T tokens keeps {kept}; needles sit {where}; `--rounding {rounding} --depths {depths}` "
        "resumes the file. The needles found by depth and length, per policy at the grid's middle ratio "
        f"({task_needles.middle_ratio(cfg['ratios'])}): `{needles_figure(cfg)}`."
    )


def frontier_rows(obj: dict) -> list[dict]:
    """The frontier's summary: as the file records it, or (a grid still running) from its rows so far."""
    from kvlens.experiments.bench.frontier import summarise

    return obj.get("summary") or summarise(obj["rows"])


def frontier_section(obj: dict) -> str:
    cfg = obj["config"]
    out = (
        "Each configuration holds the share of the full cache's bytes shown: eviction and "
        "merging keep fewer "
        "slots, quantized storage keeps every slot in fewer bits, low-rank storage keeps every "
        "slot as fewer "
        f"coefficients over a basis of the prompt's (per KV head, or xKV's shared across "
        f"{cfg.get('rank_layers')} layers), mixes do two of these. Perplexity over "
        f"{len(cfg['texts'])} bundled texts ({cfg['prefill']} + {cfg['tokens']} tokens; in "
        "brackets the lowest "
        f"and highest text); task score over {cfg['task_count']} samples of "
        f"{', '.join(f'`{t}`' for t in cfg['tasks'])} at {', '.join(map(str, cfg['task_lengths']))} tokens "
        "(in brackets the bootstrap 95 % interval).\n\n"
    )
    rows = []
    for s in sorted(
        frontier_rows(obj), key=lambda s: (s["metric"], -s["bytes_share"], s["family"], s["config"])
    ):
        ppl = s["metric"] == "ppl"
        low, high = (s["ppl_min"], s["ppl_max"]) if ppl else (s["ci_low"], s["ci_high"])
        digits = 2 if ppl else 3
        rows.append(
            [
                "perplexity" if ppl else "task score",
                s["family"],
                s["config"],
                f"{s['bytes_share']:.3f}",
                spread(f"{s[s['metric']]:.{digits}f}", f"{low:.{digits}f}", f"{high:.{digits}f}"),
            ]
        )
    return out + table(["measure", "family", "configuration", "bytes share", "value [spread]"], rows) + "\n"


def speed_section(obj: dict) -> str:
    from kvlens.figures.speed import met_text

    cfg = obj["config"]
    out = (
        f"Unmeasured runs (no perturbation meter), {cfg['steps']} decode steps at budget {cfg['budget']}. "
        "Each row is one run: prefill time, the median wall-clock time of a decode step, the "
        "largest KV cache "
        "allocated and the process's peak memory.\n\n"
    )
    rows = [
        [
            f"`{r['policy']}`",
            r["prompt_tokens"],
            f"{r['prefill_ms']:.0f}",
            f"{r['ms_per_token']:.1f}",
            f"{r['kv_bytes_peak'] / 2**20:.1f}",
            f"{r['peak_rss'] / 2**20:.0f}",
        ]
        for r in obj["rows"]
    ]
    out += table(
        ["policy", "prompt tokens", "prefill ms", "ms per token", "KV MiB (peak)", "peak RSS MiB"], rows
    )
    out += (
        "\nEvery ratio of the run: decode time, prefill time or cache bytes over its reference side (the "
        f"full cache, a floor or another policy), each the median over {cfg['repeats']} repeats run in "
        "lockstep (at least 3 for the every-policy ratios; in brackets the lowest and highest repeat where "
        "the file keeps them), and in process CPU time where measured, against their targets:\n\n"
    )
    rows = []
    cpu = obj.get("ratios_cpu", {})
    for name, value in obj["ratios"].items():
        detail = obj.get("ratio_details", {}).get(name, {})
        each = detail.get("ratios") if isinstance(detail, dict) else None
        target = obj.get("targets", {}).get(name, {})
        shown = spread(f"{value:.3f}", f"{min(each):.3f}", f"{max(each):.3f}") if each else f"{value:.3f}"
        in_cpu = f"{cpu[name]:.3f}" if name in cpu else ""
        rows.append([f"`{name}`", shown, in_cpu, target.get("target", ""), met_text(target)])
    return out + table(["ratio", "value", "CPU time", "target", "met"], rows) + "\n" + every_policy_table(obj)


EVERY = (  # the every-policy families of `kvlens bench speed`: (ratio name, column, measured in)
    ("every_policy_half_vs_full_at_{n}", "decode vs full", "wall"),
    ("every_policy_vs_floor_at_{n}", "decode vs floor", "wall"),
    ("every_policy_prefill_vs_full_at_{n}", "prefill vs full (CPU)", "cpu"),
    ("every_policy_bytes_half_vs_full_at_{n}", "bytes vs full", "wall"),
)


def every_policy_table(obj: dict) -> str:
    """Every policy at half budget, at each length of the lockstep: decode against the full cache and against
    its floor, prefill against full in CPU time and bytes against full, each the median [lowest–highest] over
    the rounds; the worst policy of each column named below the table. Empty for a file without them."""
    details = obj.get("ratio_details", {})
    lengths = sorted(int(k.rsplit("_", 1)[1]) for k in details if k.startswith("every_policy_vs_floor_at_"))
    if not lengths:
        return ""
    group = obj["config"].get("group")
    lockstep = (
        f"in lockstep groups of {group} policies per prompt length, each group beside its own full cache"
        if group
        else "in one lockstep per prompt length"
    )
    out = (
        f"\nEvery policy at half budget against the full cache, {lockstep}: "
        "its **floor** is the full cache on the tokens it keeps (the same model work over as many slots), so "
        "`decode vs floor` is what the method itself costs per step. Medians over "
        f"{max(3, obj['config']['repeats'])} rounds, [lowest–highest]:\n\n"
    )
    rows, worst = [], []
    for n in lengths:
        families = [(details.get(name.format(n=n), {}), column, unit) for name, column, unit in EVERY]
        for policy in sorted(families[1][0].get("per_policy", {})):
            rows.append(
                [f"`{policy}`", n, *(family_cell(family, unit, policy) for family, _, unit in families)]
            )
        for family, column, unit in families:
            name = family.get("worst_cpu" if unit == "cpu" else "worst")
            if name:
                worst.append(f"{column} at {n}: `{name}`")
    out += table(["policy", "prompt tokens", *(column for _, column, _ in EVERY)], rows)
    return out + "\nWorst policy: " + "; ".join(worst) + ".\n"


def phases_section(obj: dict) -> str:
    cfg = obj["config"]
    out = (
        f"Each policy generates {cfg['steps']} greedy tokens at budget {cfg['budget']}, the policies "
        f"alternating over {cfg['rounds']} rounds; timers wrap the engine's phases of the decode steps "
        "(ms per token, medians over rounds). `vs full`: the step's ratio to the full cache's in the same "
        "round, median [lowest–highest]; `beyond full` and `beyond eviction`: the step minus the full "
        f"cache's and minus `{cfg['eviction']}`'s (the cheapest eviction): what the method itself costs per "
        "token. `statistic` is the policy's per-step statistic and the attention bookkeeping.\n\n"
    )
    for tokens, rows in obj["ms_per_token"].items():
        out += f"{tokens}-token prompt:\n\n"
        body = [
            [
                f"`{name}`",
                f"{r['total']:.1f}",
                spread(f"{r['vs_full'][0]:.2f}", f"{r['vs_full'][1]:.2f}", f"{r['vs_full'][2]:.2f}"),
                f"{r['beyond_full']:+.1f}",
                f"{r['beyond_eviction']:+.1f}" if "beyond_eviction" in r else "—",
                f"{r['attention']:.1f}",
                f"{r['cache']:.1f}",
                f"{r['observe'] + r['accumulate']:.1f}",
                f"{r['compress']:.1f}",
            ]
            for name, r in sorted(rows.items(), key=lambda item: item[1]["total"])
        ]
        heads = ["policy", "ms per token", "vs full", "beyond full", "beyond eviction", "attention", "cache"]
        out += table([*heads, "statistic", "compress"], body) + "\n"
    return out


def ppl_section(obj: dict) -> str:
    cfg = obj["config"]
    out = (
        f"Teacher-forced perplexity on {len(cfg['texts'])} bundled texts ({', '.join(cfg['texts'])}), "
        f"{cfg['prefill']} prompt tokens then {cfg['tokens']} scored tokens. A budget below 1 is "
        "a share of the "
        "prompt, above 1 slots per KV head and layer. In brackets the lowest and highest text; "
        "*vs full* is the "
        "geometric-mean perplexity over the full cache's.\n\n"
    )
    rows = [
        [
            f"`{s['policy']}`",
            s["budget"],
            f"{s['budget_slots_mean']:.0f}",
            spread(f"{s['ppl_mean']:.2f}", f"{s['ppl_min']:.2f}", f"{s['ppl_max']:.2f}"),
            f3(s["vs_full"]),
        ]
        for s in obj["summary"]
    ]
    return out + table(["policy", "budget", "slots", "perplexity", "vs full"], rows) + "\n"


def needle_section(obj: dict) -> str:
    cfg = obj["config"]
    lengths = [str(n) for n in cfg["lengths"]]
    out = (
        f"A passphrase hidden at depths {', '.join(map(str, cfg['depths']))} of contexts of "
        f"{', '.join(lengths)} tokens, budget {cfg['budget']}; the score is the share of the "
        f"{len(cfg['depths'])} depths (per length) whose answer contains it.\n\n"
    )
    rows = [
        [f"`{s['policy']}`", f"{s['score']:.3f}", *(f"{s['by_length'][n]:.2f}" for n in lengths)]
        for s in obj["summary"]
    ]
    return out + table(["policy", "score", *(f"{n} tokens" for n in lengths)], rows) + "\n"


def sweep_section(obj: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in obj["rows"][0].get("params", {}).items())
    out = (
        f"`{obj['rows'][0]['policy']}` ({params}) on `{obj.get('text_file')}`, "
        f"{obj['rows'][0]['prefill']} prompt tokens then {obj.get('tokens')} scored, measured "
        "(`--measure`): the "
        "relative change of the attention output against the full cache with merging (used) and with the "
        "same decisions but no merging (evict), and KL(full ‖ policy). One text, one seed: no spread. Its "
        "time per token includes the measuring passes, so it is not shown.\n\n"
    )
    rows = [
        [
            r["budget"],
            r["budget_slots"],
            f"{r['ppl']:.2f}",
            f3(r["perturbation_used"]),
            f3(r["perturbation_evict"]),
            f3(r["kl"]),
        ]
        for r in obj["rows"]
    ]
    return out + table(
        ["budget", "slots", "perplexity", "perturbation (used)", "perturbation (evict)", "KL"], rows
    )


def explain_section(obj: dict) -> str:
    cfg, cells, done = obj["config"], obj["summary"]["cells"], obj.get("cases_done")
    out = (
        "Cache patching (`kvlens explain`, [how it works](explain.md)) on "
        f"{', '.join(cfg['tasks'])} samples at "
        f"{cfg['length']} tokens, {', '.join(cfg['policies'])} at ratios "
        f"{', '.join(map(str, cfg['ratios']))}: "
        f"{done} of {obj.get('cases_total')} (sample, policy, ratio) cases ran. Wherever the "
        "full cache answers "
        "right and the policy wrong, the greedy search restores the policy's removals one (layer, KV head) "
        "group at a time, in order of recovered share, until the greedy answer is right again. "
        "Per policy and "
        "ratio: the failing cases, how many the search fixed, the minimal set's size (median "
        "slots; mean share "
        "of the removed entries with its bootstrap 95 % interval over cases), and the share of "
        "cases fixed by "
        "at most 1 and at most 10 groups.\n\n"
    )
    rows = []
    for key, c in cells.items():
        if not c["wrong_cases"]:
            continue
        share, at = c["share_of_removed_mean_ci"], c["fixed_by_at_most"]
        rows.append(
            [
                key.replace("@", " @ ") if key != "all" else "**all**",
                c["wrong_cases"],
                c["fixed"],
                f"{c['slots_median']:.0f}",
                spread(f"{c['share_of_removed_mean']:.2f}", f"{share[0]:.2f}", f"{share[1]:.2f}"),
                *(
                    spread(f"{at[k]['share']:.2f}", f"{at[k]['ci'][0]:.2f}", f"{at[k]['ci'][1]:.2f}")
                    for k in ("1", "10")
                ),
            ]
        )
    out += table(
        [
            "policy @ ratio",
            "wrong",
            "fixed",
            "slots (median)",
            "share of removed",
            "by 1 group",
            "by ≤ 10 groups",
        ],
        rows,
    )
    top = sorted(obj["summary"]["layers"], key=lambda r: -r["share_of_sets"])[:4]
    layers = [
        f"layer {r['layer']} " + spread(f"{r['share_of_sets']:.0%}", f"{r['ci'][0]:.0%}", f"{r['ci'][1]:.0%}")
        for r in top
    ]
    out += (
        "\nThe layers most often in a minimal set (share of the fixed cases whose set holds one "
        "of the layer's "
        "KV heads, with its interval): " + "; ".join(layers) + ".\n"
    )
    return out


BUILDERS = {
    "bench_tasks.json": tasks_section,
    QUERY_AWARE: tasks_section,
    "bench_frontier.json": frontier_section,
    "bench_speed.json": speed_section,
    "decode_phases.json": phases_section,
    "bench_ppl.json": ppl_section,
    "bench_needle.json": needle_section,
    "sweep_cam_perturbation.json": sweep_section,
    "explain.json": explain_section,
}


def page() -> str:
    out = banner("the files in `results/`") + "# Benchmarks and results\n\n"
    out += (
        "Every table below is read from one file in `results/`, which records the command that made it; the "
        "app's Benchmarks page draws the same files. Everything ran the embedded "
        "SmolLM2-135M-Instruct on the "
        "machine named, on the State of the Union texts bundled in `kvlens/data/`. Re-run a command to "
        "refresh its file, then `make docs-gen`.\n\n"
    )
    out += (
        "A results file is one JSON object: `command`, `config` (the settings), `environment` "
        "(kvlens, torch, "
        "CPUs, device, dtype, the time it finished), `rows` (one record per run or cell; `cells` "
        "for the needle "
        "benchmark), `summary` (what the tables show) and, for a grid, `cells_done` of `cells_total`. A grid "
        "re-run with the same command resumes where it stopped. A sweep (`kvlens sweep`) records its command "
        "and settings but not its date and machine.\n\n"
    )
    for path in cited():
        obj = load(path.name)
        out += f"## {CITED[path.name]}\n\n" + provenance(path.name, obj) + BUILDERS[path.name](obj) + "\n"
    learned = learned_summary()
    out += f"## A learned score: kvzap against KVzip\n\n{learned}\n" if learned else ""
    return out.rstrip("\n") + "\n"


def readme_summary() -> str:
    """The task leaderboard's top at ratio 0.5, for the README."""
    from kvlens.experiments.bench import task_needles

    obj = load("bench_tasks.json")
    summary = task_summary(obj)
    full = next(s for s in summary if s["policy"] == "full")
    half = sorted((s for s in summary if s["ratio"] == 0.5), key=lambda s: -s["score"])[:5]
    env = obj["environment"]
    grid = cells_left(obj)
    elsewhere = sum(1 for r in obj["rows"] if r.get("machine"))
    grid += f"; {elsewhere} samples on another machine" if elsewhere else ""
    out = (
        "Task score at compression ratio 0.5 (half the context's cache removed), averaged over "
        "tasks and lengths, "
        f"{full['samples']} samples (`{obj['command']}`, `results/bench_tasks.json`, {env['time'][:10]}, "
        f"{machine(env)}{grid}).{grid_time(finished(obj))} The full cache scores {full['score']:.3f}; "
        f"the five best of {len({s['policy'] for s in summary}) - 1} policies, with bootstrap 95 % "
        "intervals:\n\n"
    )
    out += table(
        ["policy", "score [95 % interval]"],
        [[f"`{s['policy']}`", f"{s['score']:.3f} [{s['ci_low']:.3f}–{s['ci_high']:.3f}]"] for s in half],
    )
    figure = needles_figure(obj["config"])
    out += (
        "\nNeedles found by depth in the context and context length, per policy at the grid's middle ratio, "
        f"{task_needles.middle_ratio(obj['config']['ratios'])} (`{figure}`):\n\n"
        f"![Needles found by depth and length]({figure})\n"
    )
    out += cost_sentence(obj) + protocols_sentence(obj)
    learned = learned_summary()
    out += "\n" + learned if learned else ""
    return "\n".join([out, frontier_summary(), speed_summary(), phases_summary(), explain_summary(), ""])


def speed_summary() -> str:
    """`speed_overview` of `results/bench_speed.json`, for the README."""
    return speed_overview(load("bench_speed.json"))


def speed_overview(obj: dict) -> str:
    """Every policy at half budget, per prompt length: the worst policy of each every-policy family with its
    median [lowest–highest] over the rounds, how many policies meet the family's target, and the replay
    method's prefill beside its replay floor."""
    from kvlens.experiments.bench.speed import TARGETS

    details, env = obj["ratio_details"], obj["environment"]
    lengths = sorted(int(k.rsplit("_", 1)[1]) for k in details if k.startswith("every_policy_vs_floor_at_"))
    rows = []
    for n in lengths:
        cells, replays = [], replays_of(details, n)
        for name, _, unit in EVERY:
            family = details[name.format(n=n)]
            key = "cpu" if unit == "cpu" else "per_policy"
            worst = family["worst_cpu" if unit == "cpu" else "worst"]
            cell = f"`{worst}` " + family_cell(family, unit, worst)
            target = TARGETS.get(name.format(n=n))
            if target is not None:
                ranked = [p for p in family[key] if "prefill" not in name or p not in replays]
                met = sum(1 for p in ranked if family[key][p] <= target)
                cell += f"; {met} of {len(ranked)} ≤ {target}"
            cells.append(cell)
        rows.append([n, *cells])
    out = (
        "Every policy at half budget against the full cache "
        f"(`{obj['command']}`, `results/bench_speed.json`, {env['time'][:10]}, {machine(env)}; medians over "
        f"{max(3, obj['config']['repeats'])} rounds run side by side, [lowest–highest]). Its **floor** is "
        "the full cache on as many tokens as it keeps, so `decode vs floor` is what the method itself costs "
        "per step. The worst policy of each column, and how many meet the target:\n\n"
    )
    out += table(["prompt tokens", *(column for _, column, _ in EVERY)], rows)
    out += column_sums_sentence(obj, lengths)
    replay = [
        f"{n} tokens {details[f'replay_vs_full_prefill_at_{n}']['per_policy'][worst]:.2f}× "
        f"(its passes' forward alone {obj['ratios'][f'replay_floor_vs_full_prefill_at_{n}']:.2f}×)"
        for n in lengths
        if f"replay_floor_vs_full_prefill_at_{n}" in obj["ratios"]
        for worst in [details[f"replay_vs_full_prefill_at_{n}"]["worst"]]
    ]
    targets = obj.get("targets", {})
    exceptions = [n for n in lengths if "exception" in targets.get(f"replay_vs_full_prefill_at_{n}", {})]
    if replay:
        aimed = {n: TARGETS[k] for n in lengths if (k := f"replay_vs_full_prefill_at_{n}") in TARGETS}
        out += "\nKVzip's prefill with its replay passes over the full prefill"
        each = [
            f"≤ {t} at {' and '.join(str(n) for n in aimed if aimed[n] == t)}"
            for t in dict.fromkeys(aimed.values())
        ]
        out += f" (target {'; '.join(each)} tokens): " if aimed else ": "
        out += "; ".join(replay)
        out += (
            f". At {' and '.join(map(str, exceptions))} tokens its passes' forward alone exceeds the target, "
            "so the rule itself does: there KVzip is the exception the targets name"
            if exceptions
            else ""
        )
        out += ". Each policy and length is in [Benchmarks and results](docs/results.md).\n"
    return out


def column_sums_sentence(obj: dict, lengths: list[int]) -> str:
    """H2O's column sums alone over the full prefill (CPU time) at each length that measured them, and the
    lengths where the prefill verdict names them as the exception; "" when none did."""
    key = "column_sums_floor_vs_full_prefill_at_{n}"
    measured = [n for n in lengths if key.format(n=n) in obj.get("ratios_cpu", {})]
    if not measured:
        return ""
    each = "; ".join(
        f"{n} tokens {family_cell(floor, 'cpu', floor['worst_cpu'])}"
        for n in measured
        for floor in [obj["ratio_details"][key.format(n=n)]]
    )
    targets = obj.get("targets", {})
    named = [n for n in measured if "exception" in targets.get(f"every_policy_prefill_vs_full_at_{n}", {})]
    out = (
        "\nH2O, Scissorhands, CaM, WeightedKV, D2O and KVMerger score with the column sums of the prompt's "
        "attention, which fused attention never holds; H2O's column sums alone (one pass over the causal "
        f"triangle, nothing evicted) over the full prefill, in CPU time: {each}"
    )
    if named:
        out += (
            f". At {' and '.join(map(str, named))} tokens that alone exceeds the prefill target, so the rule "
            "itself does: there the worst of them is the exception the targets name"
        )
    return out + ".\n"


def replays_of(details: dict, n: int) -> set[str]:
    """The replay methods at `n` tokens, which the prefill family leaves out (their own ratio)."""
    return set(details.get(f"replay_vs_full_prefill_at_{n}", {}).get("per_policy", {}))


def family_cell(family: dict, unit: str, policy: str) -> str:
    """`policy`'s median in an every-policy family (in CPU time where `unit` is `cpu`) with its
    [lowest–highest] over the rounds, or with three decimals where the family keeps no spread; `—` where the
    family has no value for it."""
    median_of = family.get("cpu" if unit == "cpu" else "per_policy", {})
    bounds = family.get("cpu_spread" if unit == "cpu" else "spread", {}).get(policy)
    if policy not in median_of:
        return "—"
    if bounds:
        return spread(f"{median_of[policy]:.2f}", f"{bounds[0]:.2f}", f"{bounds[1]:.2f}")
    return f"{median_of[policy]:.3f}"


def phases_summary() -> str:
    """Decode at half budget against the full cache at each profiled length: the cheapest eviction's ratio,
    and the methods that cost most per token beyond it (`results/decode_phases.json`)."""
    obj = load("decode_phases.json")
    cfg, env = obj["config"], obj["environment"]
    parts = []
    for tokens, rows in obj["ms_per_token"].items():
        base = rows[cfg["eviction"]]
        others = sorted(
            ((n, r) for n, r in rows.items() if n not in ("full", cfg["eviction"])),
            key=lambda item: -item[1]["beyond_eviction"],
        )
        under = sum(1 for _, r in others if r["vs_full"][0] <= 1.0)
        costly = ", ".join(
            f"`{n}` {r['beyond_eviction']:+.0f} ms ({r['vs_full'][0]:.2f}× full)" for n, r in others[:3]
        )
        parts.append(
            f"at {tokens} tokens the full cache takes {rows['full']['total']:.0f} ms per token and "
            f"`{cfg['eviction']}` {base['vs_full'][0]:.2f}× that; {under} of {len(others)} other methods "
            f"decode faster than the full cache, and the most a method costs beyond the eviction is {costly}"
        )
    return (
        f"Decode at budget {cfg['budget']} against the full cache (`{obj['command']}`, "
        f"`results/decode_phases.json`, {env['time'][:10]}, {machine(env)}; ratios are medians over "
        f"{cfg['rounds']} rounds run side by side): " + "; ".join(parts) + ". Each method's phases are in "
        "[Benchmarks and results](docs/results.md).\n"
    )


def protocols_sentence(agnostic: dict) -> str:
    """The methods query-aware by design under both protocols at ratio 0.5, paired on the samples both grids
    ran; empty until the query-aware grid has a file."""
    from kvlens.experiments.bench.protocols import QUERY_AWARE_BY_DESIGN, paired

    if RESULTS / QUERY_AWARE not in cited():
        return ""
    aware = load(QUERY_AWARE)
    words = {
        "tie": "a tie",
        "query-aware": "query-aware better",
        "question-agnostic": "question-agnostic better",
    }
    first, second = finished(agnostic), finished(aware)
    found = [p for name in QUERY_AWARE_BY_DESIGN if (p := paired(first, second, name, 0.5))]
    if not found:
        return ""
    parts = [
        f"`{p['policy']}` {p['agnostic']:.3f} → {p['aware']:.3f} (difference {p['diff']:+.3f} "
        f"[{p['ci_low']:+.3f}–{p['ci_high']:+.3f}]: {words[p['verdict']]})"
        for p in found
    ]
    env = aware["environment"]
    return (
        f"\nThe query-aware grid (`{aware['command']}`, `results/{QUERY_AWARE}`, "
        f"{env['time'][:10]}, {machine(env)}) compresses the context together with the question, the setting "
        "SnapKV, PyramidKV and Ada-KV were designed for."
        + grid_time(second)
        + skipped_lengths(agnostic, aware)
        + f" At ratio 0.5 on the {found[0]['samples']} samples "
        f"both grids ran ({', '.join(map(str, found[0]['lengths']))} tokens), question-agnostic → "
        "query-aware score, with the paired bootstrap 95 % interval of the difference: "
        + "; ".join(parts)
        + ".\n"
    )


def skipped_lengths(agnostic: dict, aware: dict) -> str:
    """Why the query-aware grid lacks some of the question-agnostic grid's lengths: what those lengths took
    there on this machine (`worker_hours`); empty when it ran them all."""
    missing = set(agnostic["config"]["lengths"]) - set(aware["config"]["lengths"])
    if not missing:
        return ""
    there = worker_hours(sample_minutes(finished(agnostic)), missing)
    ran, skipped = " and ".join(map(str, aware["config"]["lengths"])), ", ".join(map(str, sorted(missing)))
    return (
        f" It runs at {ran} tokens only: the question-agnostic grid's {skipped}-token samples alone took "
        f"{there:.1f} h of one worker's time on this machine."
    )


def cost_sentence(obj: dict) -> str:
    """What a cell costs against its answers at each length, the methods' own passes (KVzip's replay) apart;
    empty for a file whose rows do not record those passes (`own_ms`)."""
    from kvlens.experiments.bench import tasks

    rows = finished(obj)
    if not any("own_ms" in res for r in rows for res in r["results"]):
        return ""
    summary = tasks.summarise(rows)
    parts = []
    for length in sorted({s["length"] for s in summary if s["task"] == "all" and s["length"] != "all"}):
        cells = [s for s in summary if s["task"] == "all" and s["length"] == length and s["policy"] != "full"]
        worst = max(cells, key=lambda s: s["cost_vs_answer"])
        own = max(cells, key=lambda s: s["own_vs_answer"])
        parts.append(
            f"at {length} tokens at most {worst['cost_vs_answer']:.2f}× (`{worst['policy']}` at ratio "
            f"{worst['ratio']}), and `{own['policy']}`'s own passes {own['own_vs_answer']:.2f}× its answers"
        )
    return (
        "\nA cell's cost (compression and answers over answers alone, median over samples, the method's own "
        "passes apart): " + "; ".join(parts) + ".\n"
    )


FAMILY_WORDS = {
    "eviction": "eviction",
    "merging": "merging",
    "quantization": "quantization",
    "low_rank": "low rank",
    "mix": "a mix",
}


def at_share(summary: list[dict], share: float) -> dict[str, dict]:
    """Each family's best configuration at byte share `share`: planned for it, or (quantization alone, whose
    bits set its bytes) measured at most 2 % above it."""
    best: dict[str, dict] = {}
    for s in summary:
        fits = s["target"] == share if s["target"] is not None else s["bytes_share"] <= share * 1.02
        better = s["family"] not in best or (
            s["ppl_vs_full"] < best[s["family"]]["ppl_vs_full"]
            if s["metric"] == "ppl"
            else s["score"] > best[s["family"]]["score"]
        )
        if fits and s["family"] != "reference" and better:
            best[s["family"]] = s
    return best


def verdict(best: dict[str, dict], value: str, low: str, high: str, lower_wins: bool) -> str:
    """Which family wins: the best, or a tie with every family whose interval overlaps the best one's."""
    if not best:
        return "no configuration"
    sign = 1 if lower_wins else -1
    top = min(best.values(), key=lambda s: sign * s[value])
    tied = [f for f, s in best.items() if s is not top and s[low] <= top[high] and s[high] >= top[low]]
    if tied:
        return "tie between " + ", ".join(FAMILY_WORDS[f] for f in [top["family"], *tied])
    return FAMILY_WORDS[top["family"]] + " wins"


def frontier_summary() -> str:
    """The frontier, for the README: each family's best configuration at each byte share with its spread,
    which family wins there (a tie where the intervals overlap), and xKV's cross-layer sharing against
    per-head rank."""
    obj = load("bench_frontier.json")
    cfg, env = obj["config"], obj["environment"]
    grid = cells_left(obj)
    ppl = [s for s in frontier_rows(obj) if s["metric"] == "ppl"]
    scored = [s for s in frontier_rows(obj) if s["metric"] == "score"]
    out = (
        f"Quality at equal KV bytes (`{obj['command']}`, `results/bench_frontier.json`, {env['time'][:10]}, "
        f"{machine(env)}{grid}): at each share of the full cache's bytes, the best configuration "
        "of each family "
        "(quantization alone: the bits that fit); perplexity over the full cache's on "
        f"{len(cfg['texts'])} texts "
        f"({cfg['prefill']} + {cfg['tokens']} tokens; in brackets the lowest and highest text)"
        + (
            f", task score on {cfg['task_count']} samples of {', '.join(cfg['tasks'])} "
            "(bootstrap 95 % interval)"
            if scored
            else ""
        )
        + ":\n\n"
    )
    rows, said = [], []
    for share in cfg["byte_shares"]:
        best, best_score = at_share(ppl, share), at_share(scored, share)
        for family in FAMILY_WORDS:
            s, t = best.get(family), best_score.get(family)
            if s is None and t is None:
                continue
            rows.append(
                [
                    f"{share:g}",
                    FAMILY_WORDS[family],
                    s["config"] if s else "—",
                    f"{s['bytes_share']:.3f}" if s else "—",
                    spread(
                        f"{s['ppl_vs_full']:.3f}",
                        f"{s['ppl_vs_full_min']:.3f}",
                        f"{s['ppl_vs_full_max']:.3f}",
                    )
                    if s
                    else "—",
                    (
                        f"{t['config']}: "
                        + spread(f"{t['score']:.2f}", f"{t['ci_low']:.2f}", f"{t['ci_high']:.2f}")
                    )
                    if t
                    else "—",
                ]
            )
        sentence = f"At {share:g} of the bytes: perplexity, " + verdict(
            best, "ppl_vs_full", "ppl_vs_full_min", "ppl_vs_full_max", True
        )
        if best_score:
            sentence += "; task score, " + verdict(best_score, "score", "ci_low", "ci_high", False)
        said.append(sentence + ".")
    out += table(
        [
            "bytes",
            "family",
            "best configuration (perplexity)",
            "bytes share",
            "perplexity / full",
            "best configuration (task score)",
        ],
        rows,
    )
    return out + "\n" + " ".join(said) + " " + cross_layer_sentence(ppl, cfg) + "\n"


def cross_layer_sentence(ppl: list[dict], cfg: dict) -> str:
    """Whether xKV's cross-layer sharing beats per-head rank at equal bytes, share by share."""
    parts = []
    for share in cfg["byte_shares"]:
        low = {s["series"]: s for s in ppl if s["family"] == "low_rank" and s["target"] == share}
        x = next((s for name, s in low.items() if "xKV" in name), None)
        h = next((s for name, s in low.items() if "per head, full-width" in name), None)
        if x is None or h is None:
            continue
        word = "ties with (the text ranges overlap)"
        if x["ppl_vs_full_max"] < h["ppl_vs_full_min"]:
            word = "beats"
        elif x["ppl_vs_full_min"] > h["ppl_vs_full_max"]:
            word = "loses to"
        parts.append(
            f"at {share:g}, {x['ppl_vs_full']:.2f} against {h['ppl_vs_full']:.2f}: xKV {word} per-head rank"
        )
    if not parts:
        return ""
    return (
        f"Cross-layer low rank (xKV, {cfg.get('rank_layers')} layers) against per-head low rank "
        "at equal bytes, "
        "both with later tokens at full width (perplexity / full, mean over texts): " + "; ".join(parts) + "."
    )


def explain_summary() -> str:
    """The cache-patching finding in one paragraph, for the README."""
    obj = load("explain.json")
    every, layers = obj["summary"]["cells"]["all"], obj["summary"]["layers"]
    share, one = every["share_of_removed_mean_ci"], every["fixed_by_at_most"]["1"]
    first, second = sorted(layers, key=lambda r: -r["share_of_sets"])[:2]
    shown = [
        f"layer {r['layer']} in {r['share_of_sets']:.0%} [{r['ci'][0]:.0%}–{r['ci'][1]:.0%}]"
        for r in (first, second)
    ]
    when = obj["environment"]["time"][:10]
    return (
        f"Why a policy loses a needle (`kvlens explain`, `results/explain.json`, {when}, "
        f"{obj.get('cases_done')} of {obj.get('cases_total')} cases of "
        f"{', '.join(obj['config']['policies'])} at ratios "
        f"{', '.join(map(str, obj['config']['ratios']))}): in "
        f"the {every['wrong_cases']} cases where the full cache answers right and the policy "
        "wrong, restoring a "
        f"median of {every['groups_median']:.0f} of the policy's (layer, KV head) groups "
        f"({every['share_of_removed_mean']:.0%} [{share[0]:.0%}–{share[1]:.0%}] of the removed entries) made "
        f"{every['fixed']} right again; one group sufficed in {one['share']:.0%} "
        f"[{one['ci'][0]:.0%}–{one['ci'][1]:.0%}]. The minimal sets concentrate in a few "
        "upper-middle layers: "
        f"{shown[0]} and {shown[1]} of them (bootstrap 95 % intervals over cases)."
    )


LEARNED = RESULTS / "kvzap"  # kvzap against the KVzip it learns: its task grids and its `bench speed` run
# the `bench speed` runs that time kvzap's prefill against KVzip's, the first one that has it cited
LEARNED_SPEED = (RESULTS / "bench_speed.json", LEARNED / "bench_speed_quick.json")
LEARNED_PREFILL = "kvzap_vs_kvzip_prefill_at_"
LEARNED_SIDES = (
    ("kvzap", 0.5, "`kvzap` at ratio 0.5"),
    ("kvzap:mode=threshold", None, "`kvzap:mode=threshold`"),
)


def learned_grid(name: str, protocol: str) -> str:
    """One protocol's kvzap cells against `kvzip` at ratio 0.5 on the same samples, paired (`against`)."""
    from kvlens.experiments.bench.protocols import against

    obj = json.loads((LEARNED / name).read_text(encoding="utf-8"))
    rows, env = finished(obj), obj["environment"]
    parts = []
    for policy, ratio, label in LEARNED_SIDES:
        d = against(rows, ("kvzip", 0.5), (policy, ratio))
        if d is None:
            continue
        kept = "" if ratio is not None else f", keeping {d['kept_share']:.0%} of the context on average"
        verdict = "a tie" if d["verdict"] == "tie" else f"`{d['verdict']}` better"
        parts.append(
            f"{label}{kept} scores {d['second']:.3f} against `kvzip`'s {d['first']:.3f} (difference "
            f"{d['diff']:+.3f} [{d['ci_low']:+.3f}–{d['ci_high']:+.3f}]: {verdict})"
        )
    own = [
        c["own_vs_answer"]
        for c in summary_of(obj)
        if (c["policy"], c["ratio"], c["task"], c["length"]) == ("kvzip", 0.5, "all", "all")
    ]
    if own:
        parts.append(
            f"in these cells `kvzip`'s replay took {own[0]:.2f}× its answers' time (median over samples), "
            "`kvzap` has no pass of its own"
        )
    return (
        f"{protocol} (`{obj['command']}`, `results/kvzap/{name}`, {env['time'][:10]}, {machine(env)}"
        f"{cells_left(obj)}; {len(rows)} samples at {', '.join(map(str, obj['config']['lengths']))} tokens, "
        "paired bootstrap 95 % intervals): " + "; ".join(parts) + "."
    )


def learned_cost(obj: dict) -> str:
    """kvzap's prefill over KVzip's (its replay included) and each one's decode over the full cache, from one
    `bench speed` run's lockstep, medians with the [lowest–highest] round."""
    details, parts = obj["ratio_details"], []
    for name in sorted((k for k in obj["ratios"] if k.startswith(LEARNED_PREFILL)), key=len):
        n = name.rsplit("_", 1)[1]
        prefill = details[name]["prefill_ms"]
        each = [a / b for a, b in zip(prefill["kvzap"], prefill["kvzip"], strict=True)]
        decode = details.get(f"every_policy_half_vs_full_at_{n}", {})
        spreads = decode.get("spread", {})
        decoded = ", ".join(
            f"`{p}` "
            + spread(f"{decode['per_policy'][p]:.2f}", f"{spreads[p][0]:.2f}", f"{spreads[p][1]:.2f}")
            for p in ("kvzap", "kvzip")
            if p in decode.get("per_policy", {})
        )
        parts.append(
            f"at {n} tokens `kvzap`'s prefill takes "
            + spread(f"{obj['ratios'][name]:.2f}", f"{min(each):.2f}", f"{max(each):.2f}")
            + "× `kvzip`'s (its replay included)"
            + (f", and decoding at half budget over the full cache's is {decoded}" if decoded else "")
        )
    env = obj["environment"]
    return (
        f"What each costs (`{obj['command']}`, `{obj['file']}`, {env['time'][:10]}, "
        f"{machine(env)}, medians over {obj['config']['repeats']} lockstep rounds): " + "; ".join(parts) + "."
    )


def learned_summary() -> str:
    """kvzap, the surrogate `kvlens train-scorer` ships for the embedded model, against the KVzip scores it
    learns: each protocol's paired task scores and the cost of each; empty before its files exist."""
    from kvlens.policies import make_policy

    grids = [
        learned_grid(name, protocol)
        for name, protocol in (("bench_tasks.json", "Question-agnostic"), (QUERY_AWARE, "Query-aware"))
        if (LEARNED / name).exists()
    ]
    if not grids:
        return ""
    speeds = [
        {**json.loads(p.read_text(encoding="utf-8")), "file": str(p.relative_to(ROOT))}
        for p in LEARNED_SPEED
        if p.exists()
    ]
    timed = [obj for obj in speeds if any(k.startswith(LEARNED_PREFILL) for k in obj.get("ratios", {}))]
    cost = " " + learned_cost(timed[0]) if timed else ""
    kvzap = make_policy("kvzap")  # its threshold mode's defaults (the grids' cells name the mode only)
    return (
        "A learned score against the one it learns: `kvzap` with the scorer `kvlens train-scorer` ships for "
        "the embedded model (`scorers/`), beside `kvzip` on the leaderboard's samples. Its ratio mode is "
        "kvpress's `KVzapPress` alone (each head's lowest predicted scores leave, no window of recent tokens "
        f"kept); its threshold mode is the paper's protocol (kvpress's `DMSPress`: what scores below "
        f"{kvzap.threshold:g} leaves once older than the {kvzap.window} newest positions, so each head keeps "
        "its own share). " + " ".join(grids) + cost + "\n"
    )


def cited() -> list[Path]:
    return [RESULTS / name for name in CITED if name not in OPTIONAL or (RESULTS / name).exists()]
