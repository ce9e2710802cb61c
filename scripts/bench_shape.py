"""What compression costs and saves on a model of a real size: a random-init model shaped like Llama-3.1-8B
(32 layers, 32 query and 8 KV heads of 128), the full cache against `h2o`, `snapkv` and `adakv` at ratio
0.5 on a long prompt: prefill ms, decode ms per token, KV bytes and the device's peak memory.

    python scripts/bench_shape.py [--shape llama-8b|tiny] [--tokens 32768] [--steps 16]
        [--policies full,h2o,snapkv,adakv] [--device cuda] [--dtype bfloat16]
        [--json results/bench_shape.json]

The weights are random (nothing is downloaded), so the decisions mean nothing, but the cost is real: the same
matrix shapes, the same cache, the same eviction. Each policy runs alone, one after the other, the device's
peak memory reset before each (`torch.cuda.max_memory_allocated`; on the CPU the process's peak resident
memory). On a lent GPU the whole 8B-shaped run takes a few minutes; run it beside the embedded model's table:

    kvlens --device cuda --dtype bfloat16 bench speed --json --out-dir results/cuda
    python scripts/bench_shape.py --device cuda --json results/bench_shape_8b.json

`tests/bench/test_bench_shape.py` runs it on the CPU with `--shape tiny`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlens.engine.attention import ATTENTION_NAME, register_attention  # noqa: E402
from kvlens.engine.models import LoadedModel, resolve_device, resolve_dtype  # noqa: E402
from kvlens.experiments.bench.common import PeakRSS, PolicySpec, environment  # noqa: E402
from kvlens.experiments.bench.speed import engine_steps, lockstep  # noqa: E402

SHAPES = {  # LlamaConfig fields
    "llama-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
    },
}


class IdTokenizer:
    """What the engine asks of a tokenizer, for a model without one: no end-of-sequence, ids as text."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [str(int(i)) for i in ids]


def shaped_model(shape: str, context: int, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A random-init `LlamaForCausalLM` of `SHAPES[shape]` with kvlens's attention, on `device` in `dtype`,
    its weights made there in `dtype` (an 8B shape in bf16 takes 16 GB, never the 32 of float32 first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=context,
        attn_implementation=ATTENTION_NAME,
        dtype=dtype,
    )
    prior = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(prior)
    return LoadedModel(model, IdTokenizer(), f"random {shape}", Path("."), device, dtype)


def measure(model: LoadedModel, policy: str, ids: list[int], steps: int, ratio: float) -> dict:
    """One policy's run alone: prefill ms, median decode ms per token, KV bytes, peak memory."""
    spec = PolicySpec(policy)
    with PeakRSS(device=model.device) as mem:
        res = lockstep({policy: lambda: engine_steps(model, spec, ids, steps, ratio)})[policy]
    cuda = mem.device_peak is not None
    return {
        "policy": policy,
        "prefill_ms": res["prefill_ms"],
        "ms_per_token": res["ms_per_token"],
        "kv_bytes_peak": res["kv_bytes_peak"],
        "peak_memory": mem.device_peak if cuda else mem.peak,
        "memory": "torch.cuda.max_memory_allocated" if cuda else "process peak RSS",
    }


def bench_shape(
    shape: str, tokens: int, steps: int, policies: list[str], device: str, dtype: str, ratio: float = 0.5
) -> dict:
    """Every policy of `policies` on `tokens` random prompt ids; ratios of decode time and memory to full."""
    dev = resolve_device(device)
    model = shaped_model(shape, tokens + steps, dev, resolve_dtype(dtype, dev))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (tokens,), generator=gen).tolist()
    lockstep({"warm-up": lambda: engine_steps(model, PolicySpec("full"), ids[:64], 2, None)})  # untimed
    rows = [measure(model, p, ids, steps, ratio) for p in policies]
    full = next((r for r in rows if r["policy"] == "full"), None)
    ratios = {}
    if full is not None:
        for r in rows:
            if r is not full:
                ratios[r["policy"]] = {
                    "decode_vs_full": r["ms_per_token"] / full["ms_per_token"],
                    "kv_bytes_vs_full": r["kv_bytes_peak"] / full["kv_bytes_peak"],
                    "peak_memory_vs_full": r["peak_memory"] / full["peak_memory"],
                }
    return {
        "config": {"shape": shape, **SHAPES[shape], "tokens": tokens, "steps": steps, "ratio": ratio},
        "environment": {**environment(), "device": str(dev), "dtype": dtype},
        "rows": rows,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=32768, help="prompt tokens")
    p.add_argument("--steps", type=int, default=16, help="generated tokens per run")
    p.add_argument("--policies", default="full,h2o,snapkv,adakv")
    p.add_argument("--ratio", type=float, default=0.5, help="share of the prompt kept")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.steps < 2:
        print("bench_shape: --tokens and --steps must be at least 2.", file=sys.stderr)
        return 2
    result = bench_shape(
        args.shape, args.tokens, args.steps, args.policies.split(","), args.device, args.dtype, args.ratio
    )
    result["command"] = "python scripts/bench_shape.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    for r in result["rows"]:
        print(
            f"{r['policy']:<10} prefill {r['prefill_ms']:9.0f} ms  decode {r['ms_per_token']:8.2f} ms/token  "
            f"KV {r['kv_bytes_peak'] / 2**30:6.2f} GiB  peak {r['peak_memory'] / 2**30:6.2f} GiB"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
