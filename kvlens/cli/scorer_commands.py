"""`kvlens train-scorer`: a KVzap scorer for a model, trained here (`kvlens.experiments.scorer_training`)."""

from __future__ import annotations

import os
import platform
import shlex
import time
from pathlib import Path

from kvlens.cli.common import add_model_args, load, print_json, read_text
from kvlens.errors import KvlensError


def register(sub) -> None:
    p = sub.add_parser(
        "train-scorer",
        help="train a KVzap scorer (one surrogate per layer predicting KVzip+ scores) for a model; "
        "the kvzap policy reads it",
    )
    add_model_args(p)
    p.add_argument("--texts", nargs="+", metavar="FILE", help="text files (default: the bundled texts)")
    p.add_argument(
        "--kind", choices=("linear", "mlp"), default="linear", help="the surrogate (kvpress: both)"
    )
    p.add_argument(
        "--out", required=True, metavar="PATH", help="the scorer file, e.g. scorers/NAME.safetensors"
    )
    p.add_argument("--tokens", type=int, default=1024, help="tokens per piece of text (default 1024)")
    p.add_argument("--per-text", type=int, default=2, help="pieces cut from each text (default 2)")
    p.add_argument("--samples", type=int, default=512, help="positions drawn per piece (default 512)")
    p.add_argument(
        "--held-out", type=int, default=2, help="the last texts, kept apart for the fit (default 2)"
    )
    p.add_argument("--epochs", type=int, default=15, help="MLP epochs (default 15)")
    p.add_argument(
        "--cache",
        metavar="DIR",
        help="where per-piece targets are kept so that an interrupted training resumes "
        "(default: the kvlens cache's scorer_targets/)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_train_scorer)


def _texts(args) -> dict[str, str]:
    from kvlens import texts

    if not args.texts:
        return texts.bundled()
    return {Path(p).stem: read_text(p) for p in args.texts}


def _check(args) -> None:
    for name in ("tokens", "per_text", "samples", "epochs"):
        if getattr(args, name) < 1:
            raise KvlensError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}.")
    if args.held_out < 1:
        raise KvlensError(
            f"--held-out must be at least 1 (the fit is reported on held-out texts), not {args.held_out}."
        )
    if not args.out.endswith(".safetensors"):
        raise KvlensError(f"--out must name a .safetensors file, not {args.out}.")


def command(args) -> str:
    """The command that trains this scorer again (stored in its file)."""
    parts = [
        "kvlens",
        "train-scorer",
        "--model",
        args.model,
        "--kind",
        args.kind,
        "--tokens",
        str(args.tokens),
    ]
    parts += [
        "--per-text",
        str(args.per_text),
        "--samples",
        str(args.samples),
        "--held-out",
        str(args.held_out),
    ]
    parts += ["--epochs", str(args.epochs)] * (args.kind == "mlp")
    parts += ["--texts", *args.texts] if args.texts else []
    return shlex.join([*parts, "--out", args.out])


def machine() -> str:
    """This machine, as a training report states it."""
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def cmd_train_scorer(args) -> int:
    import json

    from kvlens.engine import scorers
    from kvlens.engine.models import cache_root
    from kvlens.experiments import scorer_training as st
    from kvlens.progress import Progress

    _check(args)
    cfg = st.Training(
        kind=args.kind,
        tokens=args.tokens,
        per_text=args.per_text,
        samples=args.samples,
        held_out=args.held_out,
        epochs=args.epochs,
    )
    model, sources = load(args), _texts(args)
    start, cpu = time.perf_counter(), time.process_time()
    cache = Path(args.cache or cache_root() / "scorer_targets")
    with Progress("KVzip+ targets", None, "piece") as bar:
        layers, fit, sizes = st.train(
            model, sources, cfg, cache, lambda done, total, _cached: bar.to(done, total)
        )
    # to the millisecond: a short training (a tiny model) must not read 0 s
    seconds = {"wall": round(time.perf_counter() - start, 3), "cpu": round(time.process_time() - cpu, 3)}
    meta = {
        "fit": json.dumps(fit),
        "command": command(args),
        "training": json.dumps(st.settings(cfg)),
        "seconds": json.dumps(seconds),
        "machine": machine(),
    }
    scorers.save(Path(args.out), layers, model, meta)
    report = {"out": args.out, "kind": args.kind, "model": args.model, "seconds": seconds, **sizes}
    _print({**report, "machine": meta["machine"], "held_out_fit": fit}, args.json)
    return 0


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    seconds = report["seconds"]
    print(f"KVzap {report['kind']} scorer for {report['model']} -> {report['out']}")
    print(
        f"{report['train_positions']} training and {report['held_out_positions']} held-out positions; "
        f"{seconds['wall']:.1f} s wall, {seconds['cpu']:.1f} s CPU ({report['machine']})"
    )
    print("layer  held-out R²  Spearman")
    for i, row in enumerate(report["held_out_fit"]):
        print(f"{i:>5}  {row['r2']:>11.3f}  {row['spearman']:>8.3f}")
