"""Arguments and helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from kvlens.errors import KvlensError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a hub id, a directory or a .gguf file",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA, MPS, CPU), cpu, cuda, cuda:N or mps")
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own Python code to run (off by default)",
    )


def add_policy_name_args(p: argparse.ArgumentParser) -> None:
    """`--policy NAME` and its repeatable `--set KEY=VALUE` parameters."""
    p.add_argument("--policy", required=True, help="policy name (see `kvlens policies`)")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy parameter; repeat for several",
    )


def add_policy_args(p: argparse.ArgumentParser) -> None:
    add_policy_name_args(p)
    p.add_argument(
        "--budget", help="slots per KV head per layer (e.g. 64) or a share of the prompt (e.g. 0.5)"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="feed the prompt N tokens at a time and compress after each chunk, so that no layer holds "
        "more than budget + N slots (full, streaming_llm, h2o, tova)",
    )
    add_storage_args(p)


def add_storage_args(p: argparse.ArgumentParser, bits: bool = True) -> None:
    """`--kv-bits` and `--kv-rank` (unless `bits` is False: a benchmark that sets the storage per cell) and
    the quantization scheme's options."""
    if bits:
        p.add_argument(
            "--kv-bits",
            type=int,
            choices=(2, 4, 8),
            help="store keys and values at this many bits (KIVI-style, packed; default: the model's dtype)",
        )
    p.add_argument(
        "--kv-scheme",
        default="kivi",
        choices=("kivi", "token"),
        help="kivi: keys per channel, values per token (the paper's); token: both per token",
    )
    p.add_argument("--kv-group", type=int, default=64, help="quantization group size (slots or channels)")
    p.add_argument(
        "--kv-residual",
        type=int,
        default=0,
        help="newest tokens kept in full precision (KIVI's R; a multiple of --kv-group for kivi)",
    )
    if not bits:
        return
    rank = p.add_mutually_exclusive_group()
    rank.add_argument(
        "--kv-rank",
        type=int,
        metavar="R",
        help="low-rank storage: each KV head's keys and values as rank-R coefficients over a basis "
        "from an SVD of the prompt's kept rows; with --kv-bits the coefficients are quantized",
    )
    rank.add_argument(
        "--kv-rank-share",
        type=float,
        metavar="F",
        help="low-rank storage at the largest rank whose bytes (coefficients, bases, full-width "
        "tokens; codes and scales with --kv-bits) are at most F of the model-dtype cache's at the "
        "run's last step, so F is the byte share",
    )
    p.add_argument(
        "--kv-rank-layers",
        type=int,
        metavar="G",
        help="xKV: one SVD per group of G adjacent layers over all their KV heads, the coefficients "
        "shared by the group (needs --kv-rank-append full and a policy that keeps the same tokens "
        "in every head; default: one basis per layer and KV head)",
    )
    p.add_argument(
        "--kv-rank-append",
        choices=("project", "full"),
        default="project",
        help="low-rank storage's later tokens: projected onto the basis (Palu), or held at full width "
        "and counted in the bytes (xKV's code)",
    )


def storage(args):
    """The run's `Storage` from `--kv-*` (the model's dtype when --kv-bits is not given)."""
    from kvlens.kvcache.quantize import Storage

    rank = {
        "rank": getattr(args, "kv_rank", None),
        "rank_share": getattr(args, "kv_rank_share", None),
        "rank_layers": getattr(args, "kv_rank_layers", None),
        "rank_append": getattr(args, "kv_rank_append", None) or "project",
    }
    if getattr(args, "kv_bits", None) is None:
        return Storage(**rank)
    return Storage(
        bits=args.kv_bits, scheme=args.kv_scheme, group=args.kv_group, residual=args.kv_residual, **rank
    )


def load(args):
    from kvlens.engine.models import load_model

    if args.trust_remote_code:
        print("kvlens: WARNING: --trust-remote-code is on: the model's own code will run.", file=sys.stderr)
    return load_model(
        args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )


def read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise KvlensError(f"Text file {path} does not exist.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvlensError(f"{path} is not UTF-8 text.") from None
    if not text.strip():
        raise KvlensError(f"{path} is empty.")
    return text


def prompt_text(args) -> str:
    """The prompt: `--prompt`, or the text of `--prompt-file`."""
    return args.prompt if args.prompt is not None else read_text(args.prompt_file)


def command_line() -> str:
    return "kvlens " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def print_json(obj) -> None:
    print(json.dumps(obj, indent=1, default=str))


def progress(total: int, desc: str):
    """A progress bar over generated tokens (`kvlens.progress`), and the `on_step` callback that advances it
    (showing the fullest head's slots)."""
    from kvlens.progress import Progress

    bar = Progress(desc, total, "tok")

    def on_step(event):
        bar.advance(note=f"slots={max(event.kv_slots)}")

    return bar, on_step
