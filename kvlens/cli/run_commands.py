"""Subcommands that resolve models, list policies, run them and show runs."""

from __future__ import annotations

from typing import Any

from kvlens.cli.common import (
    add_model_args,
    add_policy_args,
    command_line,
    load,
    print_json,
    progress,
    prompt_text,
    read_text,
    storage,
)
from kvlens.errors import KvlensError
from kvlens.figures.wording import suffix
from kvlens.levels import LEVELS

MEASURED = (
    "perturbation_used",
    "perturbation_evict",
    "perturbation_used_median",
    "perturbation_evict_median",
    "perturbation_used_pooled",
    "perturbation_evict_pooled",
    "merge_better_share",
    "merge_worse_share",
    "merge_sign_per_layer",
    "attention_loss",
    "kl",
    "kl_steps",
    "perturbation_used_per_layer",
    "perturbation_evict_per_layer",
    "perturbation_stored",
    "perturbation_stored_median",
    "perturbation_stored_pooled",
    "perturbation_stored_per_layer",
    "perturbation_sources",
)


def register(sub) -> None:
    p = sub.add_parser("model-path", help="print the local directory of a resolved model")
    p.add_argument("--model", default="default")
    p.set_defaults(func=cmd_model_path)

    p = sub.add_parser(
        "check-model",
        help="what kvlens supports of a model: exact, or refused with the reason (exit 0 exact, 1 refused)",
    )
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check_model)

    p = sub.add_parser(
        "qfilters",
        help="compute (once) and cache the model's Q-Filters from the bundled texts "
        "(the qfilter policy reads them)",
    )
    add_model_args(p)
    p.add_argument("--fresh", action="store_true", help="recompute even when cached")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_qfilters)

    p = sub.add_parser("policies", help="list every policy with its parameters")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("generate", help="generate text under a policy and save the run")
    add_policy_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples with --seed"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument(
        "--measure", action="store_true", help="also measure output perturbation and KL to the full cache"
    )
    p.add_argument("--record", default="summary", choices=list(LEVELS))
    p.add_argument("--record-layers", help="comma-separated layers to record states/rows for (default: all)")
    p.add_argument("--out", required=True, help="run directory to write")
    add_model_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("ppl", help="teacher-forced perplexity of a text under a policy")
    add_policy_args(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--record", default="summary", choices=list(LEVELS))
    p.add_argument("--out", help="also save the run here")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--measure", action="store_true", help="also measure output perturbation and KL to the full cache"
    )
    add_model_args(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("show", help="summarise a saved run")
    p.add_argument("--run", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)


def cmd_model_path(args) -> int:
    from kvlens.engine.models import model_path

    print(model_path(args.model))
    return 0


def _per_layer(values: dict) -> str:
    return "; ".join(f"layer {i}: {v}" for i, v in values.items()) or "none"


def cmd_qfilters(args) -> int:
    from kvlens.engine import qfilters
    from kvlens.progress import Progress

    model = load(args)
    path = qfilters.path_for(model)
    with Progress("Q-Filters", qfilters.TEXTS, "text") as bar:
        filters = qfilters.filters_for(model, fresh=args.fresh, progress=lambda done, _: bar.to(done))
    report = {
        "model": args.model,
        "path": str(path),
        "layers": filters.shape[0],
        "kv_heads": filters.shape[1],
        "head_dim": filters.shape[2],
        "texts": qfilters.TEXTS,
        "tokens": qfilters.TOKENS,
        "samples": qfilters.SAMPLES,
        "fingerprint": qfilters.fingerprint(model),
    }
    if args.json:
        print_json(report)
    else:
        print(
            f"Q-Filters of {args.model}: {filters.shape[0]} layers x {filters.shape[1]} KV heads x "
            f"{filters.shape[2]}, from {qfilters.TEXTS} bundled texts of {qfilters.TOKENS} tokens -> {path}"
        )
    return 0


def cmd_check_model(args) -> int:
    from kvlens.engine.models import load_model

    model = load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        refuse=False,
    )
    sup = model.supported()
    report = {"model": args.model, "path": str(model.path), **model.shape(), **sup.as_dict()}
    if args.json:
        print_json(report)
        return int(sup.refusal is not None)
    rows = [
        ("model", f"{args.model} ({model.path})"),
        ("architecture", f"{report['architecture']} ({sup.model_class})"),
        (
            "shape",
            f"{report['layers']} layers, {report['heads']} query heads over {report['kv_heads']} KV heads, "
            f"head_dim {report['head_dim']}",
        ),
        ("tokenizer", type(model.tokenizer).__name__),
        ("positions", sup.positions),
        ("scaling", ", ".join(f"{x:.6g}" for x in sorted(set(sup.scaling))) or "n/a"),
        ("sliding", _per_layer(sup.sliding)),
        ("softcap", _per_layer(sup.softcap)),
        ("verdict", sup.verdict + suffix(": {}", sup.refusal)),
    ]
    for label, value in rows:
        print(f"{label:<13}{value}")
    return int(sup.refusal is not None)


def cmd_policies(args) -> int:
    from kvlens.policies import REGISTRY, family, parameters, policy_names, presets

    rows: list[dict[str, Any]] = [
        {
            "name": name,
            "family": family(REGISTRY[name]),
            "description": REGISTRY[name].description,
            "paper": REGISTRY[name].paper,
            "budget_free": REGISTRY[name]().budget_free,
            "merges": REGISTRY[name].merge_rule is not None,
            "parameters": [p.describe() for p in parameters(name)],
            "presets": presets(name),
        }
        for name in policy_names()
    ]
    if args.json:
        print_json(rows)
        return 0
    for row in rows:
        params = ", ".join(f"{p['name']}={p['default']}" for p in row["parameters"]) or "no parameters"
        print(f"{row['name']:<14} {row['description']}\n{'':<14} {params}")
        for preset, values in row["presets"].items():
            print(f"{'':<14} preset={preset}: {', '.join(f'{k}={v}' for k, v in values.items())}")
    return 0


def _options(args, **extra):
    from kvlens.engine.loop import RunOptions
    from kvlens.lists import parse_list
    from kvlens.policies import parse_budget

    layers = None
    if getattr(args, "record_layers", None) and args.record == "summary":
        raise KvlensError("--record-layers needs --record states or --record attention.")
    if getattr(args, "record_layers", None):
        layers = parse_list(args.record_layers, "--record-layers", minimum=0)
    return RunOptions(
        budget=parse_budget(args.budget),
        record=args.record,
        record_layers=layers,
        storage=storage(args),
        prefill_chunk=args.prefill_chunk,
        **extra,
    )


def _policy(args):
    from kvlens.policies import make_policy, parse_settings

    params = parse_settings(args.policy, args.settings)
    make_policy(args.policy, params)  # validate before loading the model
    return params


def cmd_generate(args) -> int:
    from kvlens.engine.perturbation import base_baseline
    from kvlens.experiments.api import generate
    from kvlens.experiments.bench.common import PeakRSS
    from kvlens.policies import make_policy

    params = _policy(args)
    prompt = prompt_text(args)
    if not prompt.strip():
        raise KvlensError("The prompt is empty: give some text.")
    if args.max_new_tokens < 1:
        raise KvlensError("--max-new-tokens must be at least 1.")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise KvlensError("--temperature must be >= 0 and --top-p in (0, 1].")
    opts = _options(
        args,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    model = load(args)
    bar, on_step = progress(args.max_new_tokens, f"{args.policy}")
    with bar, PeakRSS() as rss:
        run = generate(
            model,
            prompt,
            args.policy,
            params,
            opts=opts,
            chat=args.chat,
            on_step=on_step,
            meta={"command": command_line()},
            measure=args.measure,
        )
    run.meta.metrics.update({"rss_peak": rss.peak, "rss_growth": rss.peak - rss.start})
    if args.measure:
        run.meta.metrics.update(
            base_baseline(
                make_policy(args.policy, params),
                lambda name, base: generate(
                    model, prompt, name, base, opts=opts, chat=args.chat, measure=True
                ),
            )
        )
    path = run.save(args.out)
    m = run.metrics
    print(run.meta.text)
    ms = f"{m['ms_per_token']:.1f} ms/token" if m["ms_per_token"] else "one token"
    reached = f"compression ratio {m['compression_ratio_prompt']:.3f} after the prompt, "
    reached += f"{m['compression_ratio_final']:.3f} at the end"
    print(
        f"\n[{args.policy}] {len(run.meta.tokens)} tokens, {ms}, kv slots max {m['kv_slots_max']}, "
        f"{reached}, {len(run.decisions)} decisions -> {path}"
    )
    return 0


def cmd_ppl(args) -> int:
    from kvlens.engine.perturbation import base_baseline
    from kvlens.experiments.api import perplexity
    from kvlens.experiments.bench.common import PeakRSS
    from kvlens.policies import make_policy

    params = _policy(args)
    text = read_text(args.text_file)
    opts = _options(args)
    model = load(args)
    bar, on_step = progress(args.tokens, f"{args.policy} ppl")
    with bar, PeakRSS() as rss:
        run = perplexity(
            model,
            text,
            args.policy,
            params,
            prefill=args.prefill,
            tokens=args.tokens,
            opts=opts,
            on_step=on_step,
            meta={"command": command_line()},
            measure=args.measure,
        )
    run.meta.metrics.update({"rss_peak": rss.peak, "rss_growth": rss.peak - rss.start})
    if args.measure:
        run.meta.metrics.update(
            base_baseline(
                make_policy(args.policy, params),
                lambda name, base: perplexity(
                    model, text, name, base, prefill=args.prefill, tokens=args.tokens, opts=opts, measure=True
                ),
            )
        )
    if args.out:
        run.save(args.out)
    m = run.metrics
    result = {
        "policy": args.policy,
        "params": run.meta.policy.params,
        "budget": run.meta.budget.slots,
        "budget_requested": opts.budget,
        "prefill": args.prefill,
        "tokens": args.tokens,
        "nll": m["nll"],
        "ppl": m["ppl"],
        "kv_slots_max": m["kv_slots_max"],
        "kv_entries_max": m["kv_entries_max"],
        "kv_entries_budget": m["kv_entries_budget"],
        "kv_bytes_peak": m["kv_bytes_peak"],
        "kv_bytes_prefill": m["kv_bytes_prefill"],
        "rss_peak": m["rss_peak"],
        "rss_growth": m["rss_growth"],
        "ms_per_token": m["ms_per_token"],
        "prefill_ms": m["prefill_ms"],
        "storage": opts.storage.describe(),
        "prefill_chunk": opts.prefill_chunk,
    }
    if m.get("replay_passes"):  # a policy's extra passes over the prompt (KVzip), part of prefill_ms
        result.update({"replay_passes": m["replay_passes"], "replay_ms": m["replay_ms"]})
    if args.measure:
        # MEASURED, and base_* (the separate run of a merging policy's base eviction policy)
        result.update({k: v for k, v in m.items() if k in MEASURED or k.startswith("base_")})
    if args.json:
        print_json(result)
    else:
        print(
            f"{args.policy}: ppl {m['ppl']:.3f} (nll {m['nll']:.4f}) over {args.tokens} tokens after "
            f"{args.prefill}; kv slots max {m['kv_slots_max']}, {m['kv_bytes_peak'] / 2**20:.2f} MiB"
        )
    return 0


def cmd_show(args) -> int:
    from kvlens.runs.run import load_run

    run = load_run(args.run)
    meta = run.meta
    summary = {
        "model": meta.model.model_dump(),
        "policy": meta.policy.model_dump(),
        "budget": meta.budget.model_dump(),
        "mode": meta.mode,
        "prompt": meta.prompt,
        "text": meta.text,
        "metrics": meta.metrics,
        "decisions": len(run.decisions),
        "record": meta.record.model_dump(),
        "command": meta.command,
        "tensors": {k: list(v.shape) for k, v in sorted(run.tensors.items())},
    }
    if args.json:
        print_json(summary)
        return 0
    pol = meta.policy
    print(f"run       {run.path}\nmodel     {meta.model.spec} {meta.model.shape}")
    print(f"policy    {pol.name} {pol.params}  budget {summary['budget']}")
    print(f"prompt    {summary['prompt']!r}\ntext      {summary['text']!r}")
    for k, v in (summary["metrics"] or {}).items():
        print(f"  {k:<20} {v}")
    print(f"decisions {summary['decisions']}\ntensors")
    for k, shape in summary["tensors"].items():
        print(f"  {k:<24} {shape}")
    return 0
