"""Independent reference values from NVIDIA kvpress for `tests/cross_checks/test_kvpress_crosscheck.py`.

    python scripts/crosscheck_kvpress.py [--venv DIR] [--model DIR] [--only CASE ...]

kvpress needs transformers < 5.3, so this script builds its own virtualenv (default
`~/.cache/kvlens/kvpress-venv`, never inside the repository), installs the pinned kvpress, torch
and transformers there, re-runs itself inside it and writes `tests/data/kvpress_reference.json`:
the token ids it scored, the per-step negative log-likelihoods under each case, the versions and
this command. CI never installs kvpress: the test compares kvlens with the stored values. `--only`
recomputes the named prompt cases and keeps every other stored value as it is.

Where kvlens and kvpress define a policy the same way, the two must agree: the embedded
SmolLM2-135M, a prompt of PREFILL tokens compressed to BUDGET slots right after prefill, then
teacher-forced decode steps, each compressing back to BUDGET.
- `streaming_llm`: kvpress `StreamingLLMPress` (prefill) + `DecodingPress(StreamingLLMPress)`.
  kvpress's `ScorerPress.compress` keeps `topk` indices unsorted, so its decoding StreamingLLM
  evicts the wrong slots (kvpress issue #173); the reference sorts the kept indices.
- `cam`: `CAMPress(StreamingLLMPress, merge_budget=32)` during decoding with every Bernoulli draw
  1, the prompt compressed by `StreamingLLMPress`; kvlens `cam` preset `kvpress`, `mask=always`.
- `h2o`: kvpress's `ObservedAttentionPress` scores the *mean* attention a slot received in the
  prompt (column sum / queries that saw it) and nothing across decode steps, so the reference is a
  `ScorerPress` with H2O's own score, run by kvpress's prefill and `DecodingPress` hooks: the raw
  accumulated attention (the prompt's column sums, then every decode row added; a KV head's is the
  mean of its query heads') with kvlens's recent window (`recent_ratio` 0.5 of the budget) kept.
- `tova`: kvpress `TOVAPress` without its pin of the newest token (it scores the last query's
  attention to every slot but its own, then gives the newest slot max + 1; TOVA and kvlens score
  all slots, the newest included).

The methods kvpress compresses the prompt with only (`prompt_cases`): on two bundled texts of
PROMPT_LEN tokens at compression ratios RATIOS (kvpress's share removed; kvlens's budget is the
rest), the positions each layer and KV head lost in the prompt's compression, and the NLL of the
next two tokens (the prompt's logits, then one decode step over the compressed cache). kvpress's
press as shipped, with the same parameters: `SnapKVPress` (window 16, kernel 5), `PyramidKVPress`
(window 16, beta 4, so that the pyramid is not kvpress's uniform fallback at these lengths),
`AdaKVPress` over SnapKV and over `ExpectedAttentionPress`, `ExpectedAttentionPress`,
`KnormPress`, `KeyDiffPress` and `KVzipPress` (chunks of 128 tokens; made to reconstruct the whole
prompt, which has no chat template's prefix to skip). AdaKV and KVzip keep every key and mask the
evicted ones (fake keys); their removed positions are the masked ones. ThinK: `ComposedPress` of that
SnapKV and `ThinKPress` (window 32) pruning THINK_RATIOS of the key channels, which it zeroes; the
channels each layer and KV head kept are the ones not all zero, and the removed positions are matched on
them. KVzap: kvpress's `KVzapPress` (0.5.5 downloads `nvidia/KVzap-{linear,mlp}-{model}` from the hub
in `post_init_from_model` unless its `kvzap_model_name` already is that name, so `kvzap_press` sets the
name and a `KVzapModel` holding kvlens's shipped scorer, `scorers/smollm2-135m-instruct-linear.safetensors`,
in memory), alone at the two ratios (kvlens `kvzap`, `mode=ratio`) and inside `DMSPress` (threshold
KVZAP_THRESHOLD, a window of KVZAP_WINDOW, the prompt only: kvlens `mode=threshold`, `decoding=once`; the
same removal at both ratios, which it ignores).

The task protocol (`task_cases`, `tests/data/kvpress_task_reference.json`): 4 samples of the task suite
(`TASK_SAMPLES`, written by kvlens to `tests/data/kvpress_task_samples.jsonl`, answers of TASK_TOKENS
tokens) through kvpress's own `KVPressTextGenerationPipeline` (the chat template's context compressed once,
each question appended and answered greedily from it), for the full cache, `StreamingLLMPress`,
`SnapKVPress` (window 16, kernel 5), `ExpectedAttentionPress`, TOVA (unpinned, as above), `KVzipPress` as
shipped (it skips the chat template's head: kvlens `reconstruct=context`) and `AdaKVPress` over SnapKV, at
TASK_RATIOS: the token ids of context and questions, the answers, and per layer a digest of the positions
each KV head lost in the context's compression (run again outside the pipeline; kvpress's kept count,
`int(T * (1 - ratio))`, is kvlens's `--rounding kvpress`). Each question is "\n\n" + the sample's, as
kvlens's `split_prompt` asks it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "kvpress_reference.json"
TASK_OUT = ROOT / "tests" / "data" / "kvpress_task_reference.json"
TASK_SAMPLES_FILE = ROOT / "tests" / "data" / "kvpress_task_samples.jsonl"
VENV = Path.home() / ".cache" / "kvlens" / "kvpress-venv"
PINS = ["kvpress==0.5.5", "torch==2.13.0", "transformers>=4.56,<5.3"]
TEXT = ROOT / "kvlens" / "data" / "state_union" / "1946-Truman.txt"
PREFILL, STEPS, BUDGET, SINK, RECENT_RATIO = 64, 12, 24, 4, 0.5
PROMPT_TEXTS = ("1946-Truman.txt", "1961-Kennedy.txt")
PROMPT_LEN, RATIOS, WINDOW, PROMPT_STEPS = 256, (0.5, 0.75), 16, 2
SCORER = ROOT / "scorers" / "smollm2-135m-instruct-linear.safetensors"  # kvlens's shipped KVzap scorer
KVZAP_THRESHOLD, KVZAP_WINDOW = -4.0, 64  # DMSPress: kvpress's README threshold, a window inside PROMPT_LEN
THINK_WINDOW, THINK_RATIOS = (
    32,
    {"think_snapkv": 0.5, "think_snapkv_quarter": 0.25},
)  # case -> channels pruned
# prompt case -> the kvlens policy and parameters that define the same thing as kvpress's press
PROMPT_CASES = {
    "snapkv": ("snapkv", {"window": WINDOW, "kernel": 5, "pooling": "avg"}),
    "pyramidkv": (
        "pyramidkv",
        {"schedule": "kvpress", "window": WINDOW, "beta": 4.0, "base.window": WINDOW, "base.kernel": 5},
    ),
    "adakv_snapkv": ("adakv", {"base": "snapkv", "base.window": WINDOW, "alpha": 0.2}),
    "adakv_expected_attention": ("adakv", {"base": "expected_attention", "alpha": 0.2}),
    "expected_attention": ("expected_attention", {}),
    "knorm": ("knorm", {}),
    "keydiff": ("keydiff", {}),
    "kvzip": ("kvzip", {"chunk": 128, "decoding": "once"}),
    "kvzap": ("kvzap", {"mode": "ratio", "decoding": "once"}),
    "kvzap_threshold": (
        "kvzap",
        {"mode": "threshold", "threshold": KVZAP_THRESHOLD, "window": KVZAP_WINDOW, "decoding": "once"},
    ),
    **{
        case: (
            "think",
            {
                "ratio": ratio,
                "window": THINK_WINDOW,
                "recent": 0,
                "base": "snapkv",
                "base.window": WINDOW,
                "base.kernel": 5,
                "base.pooling": "avg",
            },
        )
        for case, ratio in THINK_RATIOS.items()
    },
}
# case -> the kvlens policy and parameters that define the same thing
TASK_SAMPLES = [("niah_single", 0), ("niah_single", 1), ("niah_multikey", 0), ("niah_multiquery", 1)]
TASK_LENGTH, TASK_COUNT, TASK_TOKENS, TASK_RATIOS = 512, 2, 32, (0.5, 0.75)
TASK_CASES = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {"sink": SINK}),
    "snapkv": ("snapkv", {"window": WINDOW, "kernel": 5, "pooling": "avg"}),
    "expected_attention": ("expected_attention", {}),
    "tova": ("tova", {}),
    "kvzip": ("kvzip", {"reconstruct": "context", "decoding": "once"}),
    "adakv": ("adakv", {"base": "snapkv", "base.window": WINDOW, "alpha": 0.2}),
}
CASES = {
    "streaming_llm": ("streaming_llm", {"sink": SINK}),
    "cam": ("cam", {"preset": "kvpress", "mask": "always", "base.sink": SINK}),
    "h2o": ("h2o", {"recent_ratio": RECENT_RATIO}),
    "tova": ("tova", {}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=VENV, help="virtualenv for kvpress (built if missing)")
    parser.add_argument("--model", help="the embedded model's directory (default: `kvlens model-path`)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(PROMPT_CASES), help="recompute these prompt cases only"
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return reference(args.model, args.only)
    model = (
        args.model
        or subprocess.run(
            [str(ROOT / ".venv" / "bin" / "kvlens"), "model-path"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    python = args.venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(args.venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    dump_task_samples(model)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # kvpress's own stack only
    only = ["--only", *args.only] if args.only else []
    subprocess.run([str(python), __file__, "--inside", "--model", model, *only], check=True, env=env)
    tasks = "" if args.only else f", {TASK_SAMPLES_FILE.relative_to(ROOT)}, {TASK_OUT.relative_to(ROOT)}"
    print(f"wrote {OUT.relative_to(ROOT)}{tasks}")
    return 0


def dump_task_samples(model_dir: str) -> None:
    """With kvlens: the task samples (`kvlens bench tasks --lengths 512 --count 2 --dump-samples`, answers cut
    to TASK_TOKENS tokens)."""
    import dataclasses

    from kvlens.engine.models import load_model
    from kvlens.experiments.bench import ruler
    from kvlens.texts import bundled

    tok = load_model(model_dir).tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    haystack = " ".join(bundled().values())
    ruler.write_samples(
        [
            dataclasses.replace(
                ruler.generate(t, TASK_LENGTH, i, count, haystack, count=TASK_COUNT),
                max_new_tokens=TASK_TOKENS,
            )
            for t, i in TASK_SAMPLES
        ],
        TASK_SAMPLES_FILE,
    )


def removed_digest(removed: list[list[int]]) -> str:
    """A layer's removed positions per KV head, as a short digest (the test computes the same)."""
    import hashlib

    return hashlib.sha256(json.dumps(removed).encode()).hexdigest()[:16]


def reference(model_dir: str, only: list[str] | None = None) -> int:
    """Inside the kvpress virtualenv: score the text under each case and write the JSON (`only`: those prompt
    cases, the rest as stored, written by the same versions)."""
    from importlib.metadata import version

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    versions = {p: version(p) for p in ("kvpress", "torch", "transformers")}
    if only:
        result = json.loads(OUT.read_text(encoding="utf-8"))
        assert result["versions"] == versions, f"the stored reference was written by {result['versions']}"
        result["prompt_cases"].update(prompt_references(model_dir, tok, torch, only))
        return write(result)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = tok(TEXT.read_text(encoding="utf-8"))["input_ids"][: PREFILL + STEPS]
    ratio = (PREFILL - BUDGET) / PREFILL
    assert int(PREFILL * (1 - ratio)) == BUDGET, "pick PREFILL and BUDGET whose ratio rounds exactly"
    nll, removed = decode_references(model, ids, ratio, torch)
    prompt_cases = prompt_references(model_dir, tok, torch)
    task = task_references(model_dir, tok, torch)
    TASK_OUT.write_text(
        json.dumps(
            {"command": "python scripts/crosscheck_kvpress.py", "versions": versions, **task}, indent=1
        )
        + "\n",
        encoding="utf-8",
    )
    result = {
        "command": "python scripts/crosscheck_kvpress.py",
        "text": TEXT.relative_to(ROOT).as_posix(),
        "ids": ids,
        "prefill": PREFILL,
        "steps": STEPS,
        "budget": BUDGET,
        "versions": versions,
        "cases": {
            case: {
                "policy": CASES[case][0],
                "params": CASES[case][1],
                "nll": nll[case],
                "removed": removed[case],
            }
            for case in nll
        },
        "prompt": {
            "texts": [f"kvlens/data/state_union/{t}" for t in PROMPT_TEXTS],
            "prefill": PROMPT_LEN,
            "steps": PROMPT_STEPS,
            "ratios": list(RATIOS),
        },
        "prompt_cases": prompt_cases,
    }
    return write(result)


def kept_in_order(scores, n_kept):
    """The `n_kept` highest-scoring slots of each KV head, in position order (kvpress issue #173)."""
    return scores.topk(n_kept, dim=-1).indices.sort(-1).values


def gather_kept(module, keys, values, index):
    """The keys and values `(B, Hkv, S, D)` at the slots `index` `(B, Hkv, kept)`."""
    index = index.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
    return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()


def sorted_compress(self, module, hidden_states, keys, values, attentions, kwargs):
    """Inside the kvpress virtualenv: `ScorerPress.compress` with the kept indices in position order."""
    from kvpress.utils import compute_n_kept

    if self.compression_ratio == 0:
        return keys, values
    scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
    return gather_kept(
        module, keys, values, kept_in_order(scores, compute_n_kept(keys.shape[2], self.compression_ratio))
    )


def h2o_scorer():
    """Inside the kvpress virtualenv: a `ScorerPress` with H2O's score (see the module docstring)."""
    import torch.nn.functional as F
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept

    @dataclass
    class H2OScorer(ScorerPress):
        """H2O's score on kvpress's hooks: raw accumulated attention, the `recent` newest slots always
        kept."""

        recent: int = 0
        sums: dict = field(
            default_factory=dict
        )  # layer -> (1, Hkv, S), shared by the prefill and decoding press

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            b, hkv, s, _ = keys.shape
            # a KV head's attention is the mean of its query heads'; summed over the rows (the prompt's, or
            # this step's)
            received = attentions.view(b, hkv, -1, attentions.shape[2], s).mean(2).sum(2)
            if attentions.shape[2] == 1:  # decoding: add to the sums so far, the new slot starting at 0
                previous = self.sums[module.layer_idx]
                received = F.pad(previous, (0, s - previous.shape[-1])) + received
            self.sums[module.layer_idx] = received
            scores = received.clone()
            scores[..., s - self.recent :] = float("inf")
            return scores

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            if self.compression_ratio == 0:
                return keys, values
            index = kept_in_order(scores, compute_n_kept(keys.shape[2], self.compression_ratio))
            self.sums[module.layer_idx] = self.sums[module.layer_idx].gather(2, index)
            return gather_kept(module, keys, values, index)

    return H2OScorer


def decode_presses(ratio: float) -> dict:
    """Inside the kvpress virtualenv: each decode case's press, the prompt compressed at `ratio`, then every
    decode step back to BUDGET (see the module docstring)."""
    from kvpress import CAMPress, DecodingPress, PrefillDecodingPress, StreamingLLMPress

    H2OScorer, UnpinnedTOVAPress = h2o_scorer(), unpinned_tova()

    def decoding(scorer_press):
        return DecodingPress(base_press=scorer_press, compression_interval=1, target_size=BUDGET)

    recent, sums = int(BUDGET * RECENT_RATIO), {}
    return {
        "streaming_llm": PrefillDecodingPress(
            prefilling_press=StreamingLLMPress(compression_ratio=ratio, n_sink=SINK),
            decoding_press=decoding(StreamingLLMPress(n_sink=SINK)),
        ),
        "cam": PrefillDecodingPress(
            prefilling_press=StreamingLLMPress(compression_ratio=ratio, n_sink=SINK),
            decoding_press=CAMPress(
                base_press=StreamingLLMPress(n_sink=SINK),
                compression_interval=1,
                target_size=BUDGET,
                merge_budget=32,
            ),
        ),
        "h2o": PrefillDecodingPress(
            prefilling_press=H2OScorer(compression_ratio=ratio, recent=recent, sums=sums),
            decoding_press=decoding(H2OScorer(recent=recent, sums=sums)),
        ),
        "tova": PrefillDecodingPress(
            prefilling_press=UnpinnedTOVAPress(compression_ratio=ratio),
            decoding_press=decoding(UnpinnedTOVAPress()),
        ),
    }


def decode_references(model, ids: list[int], ratio: float, torch) -> tuple[dict, dict]:
    """Inside the kvpress virtualenv: each decode case's per-step NLL and removed positions (`score`), with
    `ScorerPress.compress` keeping its indices in position order and every Bernoulli draw 1."""
    from unittest import mock

    from kvpress.presses.scorer_press import ScorerPress

    presses = decode_presses(ratio)
    nll, removed = {}, {}
    with (
        mock.patch.object(ScorerPress, "compress", sorted_compress),
        mock.patch("torch.bernoulli", lambda p, *a, **k: torch.ones_like(p)),
        torch.no_grad(),
    ):
        for case, press in presses.items():
            nll[case], removed[case] = score(model, press, ids, torch)
    return nll, removed


def write(result: dict) -> int:
    """The reference JSON, one line per case."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    blocks = ("cases", "prompt_cases")
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in result.items() if k not in blocks]
    body = [
        f" {json.dumps(b)}: {{\n"
        + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in result[b].items())
        + "\n }"
        for b in blocks
    ]  # one line per case
    OUT.write_text("{\n" + "\n".join(head) + "\n" + ",\n".join(body) + "\n}\n", encoding="utf-8")
    return 0


def unpinned_tova():
    """Inside the kvpress virtualenv: `TOVAPress` scoring every slot, the newest included, by the last query's
    mean attention (no pin; eager attention)."""
    from kvpress import TOVAPress

    class UnpinnedTOVAPress(TOVAPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return attentions[..., -1:, :].mean(1).repeat(1, keys.shape[1], 1)

    return UnpinnedTOVAPress


def prompt_presses(model) -> dict:
    """Inside the kvpress virtualenv: each prompt case's press at a compression ratio, `{case: ratio ->
    press}` (see the module docstring)."""
    from kvpress import (
        AdaKVPress,
        ComposedPress,
        DMSPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        PyramidKVPress,
        SnapKVPress,
        ThinKPress,
    )

    class WholePromptKVzip(KVzipPress):
        """`KVzipPress` reconstructing the whole prompt: it has no chat template's prefix to skip."""

        def _perform_kvzip_compression(self, model, tokenizer):
            self.prefix_length = 0
            super()._perform_kvzip_compression(model, tokenizer)

    return {
        "snapkv": lambda r: SnapKVPress(r, window_size=WINDOW, kernel_size=5),
        "pyramidkv": lambda r: PyramidKVPress(r, window_size=WINDOW, kernel_size=5, beta=4),
        "adakv_snapkv": lambda r: AdaKVPress(SnapKVPress(r, window_size=WINDOW, kernel_size=5), 0.2),
        "adakv_expected_attention": lambda r: AdaKVPress(ExpectedAttentionPress(r), 0.2),
        "expected_attention": lambda r: ExpectedAttentionPress(r),
        "knorm": lambda r: KnormPress(r),
        "keydiff": lambda r: KeyDiffPress(r),
        "kvzip": lambda r: WholePromptKVzip(r, chunk_size=128),
        "kvzap": lambda r: kvzap_press(model, r),
        "kvzap_threshold": lambda r: DMSPress(
            kvzap_press(model, 0.0), threshold=KVZAP_THRESHOLD, sliding_window_size=KVZAP_WINDOW
        ),
        **{
            case: lambda r, k=k: ComposedPress(
                [SnapKVPress(r, window_size=WINDOW, kernel_size=5), ThinKPress(k, window_size=THINK_WINDOW)]
            )
            for case, k in THINK_RATIOS.items()
        },
    }


def think_channels() -> dict:
    """Inside the kvpress virtualenv: `ThinKPress.compress` patched to record the key channels each layer
    kept; the record, `{layer: (Hkv, D) bool}`, filled by each compression."""
    from kvpress import ThinKPress

    channels: dict = {}
    think_compress = ThinKPress.compress

    def tracked(self, module, hidden_states, keys, values, attentions, kwargs):
        keys, values = think_compress(self, module, hidden_states, keys, values, attentions, kwargs)
        channels[module.layer_idx] = (keys[0] != 0).any(1)
        return keys, values

    ThinKPress.compress = tracked
    return channels


def prompt_references(model_dir: str, tok, torch, only: list[str] | None = None) -> dict:
    """Inside the kvpress virtualenv: every prompt case (or those in `only`) on every text and ratio (see the
    module docstring)."""
    from transformers import AutoModelForCausalLM

    channels = think_channels()  # layer -> (Hkv, D) bool, the channels ThinK kept
    # AdaKV and KVzip refuse eager attention (they mask keys inside SDPA)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    presses = prompt_presses(model)
    assert set(presses) == set(PROMPT_CASES)
    out = {}
    for case, make in presses.items():
        if only and case not in only:
            continue
        policy, params = PROMPT_CASES[case]
        runs = []
        for name in PROMPT_TEXTS:
            runs += prompt_text_runs(model, case, make, name, tok, channels, torch)
        out[case] = {"policy": policy, "params": params, "runs": runs}
        print(f"{case}: done")
    return out


def prompt_text_runs(model, case: str, make, name: str, tok, channels: dict, torch) -> list[dict]:
    """Inside the kvpress virtualenv: one prompt case's press `make` at each ratio on the bundled text `name`:
    the budget, the NLL of the next two tokens, the positions removed and (ThinK) the key channels kept."""
    from transformers import DynamicCache

    ids = tok((ROOT / "kvlens" / "data" / "state_union" / name).read_text(encoding="utf-8"))["input_ids"]
    ids = ids[: PROMPT_LEN + PROMPT_STEPS]
    prompt = torch.tensor([ids[:PROMPT_LEN]])
    runs = []
    with torch.no_grad():
        full = DynamicCache()
        model(input_ids=prompt, past_key_values=full)
        for ratio in RATIOS:
            nll, removed, kept = compressed_prompt(model, make(ratio), ids, prompt, full, channels, torch)
            entry = {
                "text": name,
                "ratio": ratio,
                "budget": int(PROMPT_LEN * (1 - ratio)),
                "nll": nll,
                "removed": removed,
            }
            if case in THINK_RATIOS:
                d = kept[0].shape[-1]
                assert all(int(k.sum(-1).min()) == d - int(d * THINK_RATIOS[case]) for k in kept)
                entry["channels"] = [[h.nonzero()[:, 0].tolist() for h in k] for k in kept]
            runs.append(entry)
    return runs


def compressed_prompt(model, press, ids: list[int], prompt, full, channels: dict, torch) -> tuple:
    """Inside the kvpress virtualenv: `prompt` `(1, PROMPT_LEN)` compressed by `press`, then one decode step
    of `ids`' next token: the NLL of the next two tokens, the positions each layer's KV heads lost against the
    uncompressed cache `full`, and each layer's key channels ThinK kept (`(Hkv, D)` bool, None without
    ThinK)."""
    from transformers import DynamicCache

    layers = [layer.self_attn for layer in model.model.layers]
    cache = DynamicCache()
    channels.clear()
    with press(model):
        logits = model(input_ids=prompt, past_key_values=cache).logits[0, -1]
    # ThinK zeroes its pruned channels: match the keys on the kept ones
    kept = [channels.get(i) for i in range(len(layers))]
    removed = [
        removed_from(
            full.layers[i].keys[0] if kept[i] is None else full.layers[i].keys[0] * kept[i][:, None, :],
            cache.layers[i].keys[0],
            getattr(layers[i], "masked_key_indices", None),
            torch,
        )
        for i in range(len(layers))
    ]
    nll = [float(-torch.log_softmax(logits.float(), -1)[ids[PROMPT_LEN]])]
    logits = model(
        input_ids=torch.tensor([[ids[PROMPT_LEN]]]),
        past_key_values=cache,
        position_ids=torch.tensor([[PROMPT_LEN]]),
    ).logits[0, -1]
    nll.append(float(-torch.log_softmax(logits.float(), -1)[ids[PROMPT_LEN + 1]]))
    for module in layers:
        module.masked_key_indices = None
    return nll, removed, kept


def kvzap_press(model, ratio: float):
    """kvpress's `KVzapPress` around kvlens's shipped scorer held in memory. Its `post_init_from_model`
    downloads `nvidia/KVzap-{model_type}-{name}` only when `kvzap_model_name` is not that name, so the name
    and a `KVzapModel` holding the scorer's weights (`L.w1`, `L.b1`: each layer's `nn.Linear`) are set
    first."""
    from kvpress import KVzapPress
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from safetensors.torch import load_file

    weights = load_file(SCORER)
    out_dim, in_dim = weights["0.w1"].shape
    config = KVzapConfig(input_dim=in_dim, output_dim=out_dim, n_modules=model.config.num_hidden_layers)
    surrogate = KVzapModel(config)
    for i, layer in enumerate(surrogate.layers):
        layer.weight.data, layer.bias.data = weights[f"{i}.w1"], weights[f"{i}.b1"]
    press = KVzapPress(compression_ratio=ratio, model_type="linear")
    press.kvzap_model_name = f"nvidia/KVzap-linear-{model.config.name_or_path.split('/')[-1]}"
    press.kvzap_model = surrogate
    return press


def task_presses() -> dict:
    """Inside the kvpress virtualenv: each task case's press at a compression ratio, `{case: ratio -> press}`
    (the full cache: None; see the module docstring)."""
    from kvpress import AdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress, StreamingLLMPress

    return {
        "full": lambda r: None,
        "streaming_llm": lambda r: StreamingLLMPress(r, n_sink=SINK),
        "snapkv": lambda r: SnapKVPress(r, window_size=WINDOW, kernel_size=5),
        "expected_attention": ExpectedAttentionPress,
        "tova": unpinned_tova(),
        "kvzip": KVzipPress,
        "adakv": lambda r: AdaKVPress(SnapKVPress(r, window_size=WINDOW, kernel_size=5), 0.2),
    }


def task_references(model_dir: str, tok, torch) -> dict:
    """Inside the kvpress virtualenv: every task case on every sample and ratio (see the module docstring)."""
    from kvpress import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM

    presses = task_presses()
    assert set(presses) == set(TASK_CASES)
    models = {
        kind: AutoModelForCausalLM.from_pretrained(
            model_dir, torch_dtype=torch.float32, attn_implementation=kind
        ).eval()
        for kind in ("eager", "sdpa")
    }
    samples = [
        json.loads(line) for line in TASK_SAMPLES_FILE.read_text(encoding="utf-8").splitlines() if line
    ]
    ids, cases = [], {case: {"policy": p, "params": q, "runs": []} for case, (p, q) in TASK_CASES.items()}
    for index, sample in enumerate(samples):
        asked = sample["question"] if isinstance(sample["question"], list) else [sample["question"]]
        questions = ["\n\n" + q for q in asked]  # as kvlens's split_prompt asks them
        for case, make in presses.items():
            model = models["sdpa" if case in ("kvzip", "adakv") else "eager"]  # AdaKV, KVzip refuse eager
            pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
            inputs = pipe.preprocess(sample["context"], questions, "", 10**10)
            if case == "full":
                ids.append(
                    {
                        "context": inputs["context_ids"][0].tolist(),
                        "questions": [q[0].tolist() for q in inputs["questions_ids"]],
                    }
                )
            runs = task_runs(model, pipe, case, make, sample, questions, inputs["context_ids"], torch)
            cases[case]["runs"] += [{"sample": index, **run} for run in runs]
        print(f"task sample {index}: done")
    return {
        "samples": TASK_SAMPLES_FILE.relative_to(ROOT).as_posix(),
        "ratios": list(TASK_RATIOS),
        "ids": ids,
        "cases": cases,
    }


def task_runs(model, pipe, case: str, make, sample: dict, questions: list[str], context, torch) -> list[dict]:
    """Inside the kvpress virtualenv: one task case's press `make` at each ratio (the full cache: at 0) on one
    sample, `context` its context's ids `(1, T)`: the ratio, the pipeline's answers and per layer the digest
    of the positions each KV head lost."""
    from transformers import DynamicCache

    layers = [layer.self_attn for layer in model.model.layers]
    runs = []
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=context, past_key_values=full)
        for ratio in [0.0] if case == "full" else TASK_RATIOS:
            answers = pipe(
                sample["context"],
                questions=questions,
                press=make(ratio),
                max_new_tokens=sample["max_new_tokens"],
            )["answers"]
            removed = []
            if case != "full":
                cache = DynamicCache()
                with make(ratio)(model):
                    model.model(input_ids=context, past_key_values=cache)
                removed = [
                    removed_digest(
                        removed_from(
                            full.layers[i].keys[0],
                            cache.layers[i].keys[0],
                            getattr(layers[i], "masked_key_indices", None),
                            torch,
                        )
                    )
                    for i in range(len(layers))
                ]
            for module in layers:
                module.masked_key_indices = None
            runs.append({"ratio": ratio, "answers": answers, "removed": removed})
    return runs


def removed_from(before, after, masked, torch) -> list[list[int]]:
    """Per KV head, the sorted positions a compression removed: the prompt's keys `before` `(Hkv, T, D)` the
    kept keys `after` `(Hkv, S, D)` do not match (keys are never merged, so each kept key is one of them
    exactly), and the masked ones (`masked_key_indices`: batch, head and position indices, fake-key
    compression)."""
    hkv, t = before.shape[:2]
    gone = [set(range(t)) for _ in range(hkv)]
    match = (after[:, :, None, :] == before[:, None, :, :]).all(-1)  # (Hkv, S, T)
    assert bool((match.sum(-1) == 1).all()), "every kept key is exactly one of the prompt's keys"
    for h in range(hkv):
        gone[h] -= set(match[h].float().argmax(-1).tolist())
    if masked is not None:
        _, heads, positions = masked
        for h, p in zip(heads.tolist(), positions.tolist(), strict=True):
            gone[h].add(p)
    return [sorted(g) for g in gone]


def score(model, press, ids, torch) -> tuple[list[float], list[list[list[list[int]]]]]:
    """Per-step NLL of ids[PREFILL:] (the prompt's logits, then one teacher-forced decode step each) and the
    positions each compression removed, `[step][layer][kv_head]` (step 0: the prompt's compression).

    Positions are tracked outside kvpress: every `compress` call's kept keys are matched, row by row,
    to the keys it was given (keys are never merged, so each kept key is one of them exactly)."""
    from transformers import DynamicCache

    layers = model.config.num_hidden_layers
    positions: dict[int, torch.Tensor] = {}  # layer -> (Hkv, S) original position of each cached key
    removed: list[list[list[list[int]]]] = []
    step = [0]

    def tracked(compress):
        def wrapper(module, hidden_states, keys, values, attentions, kwargs):
            new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            layer, s = module.layer_idx, keys.shape[2]
            before = positions.get(layer, torch.empty(keys.shape[1], 0, dtype=torch.long))
            start = 0 if step[0] == 0 else PREFILL + step[0] - 1  # the prompt, then one token per step
            before = torch.cat(
                [before, torch.arange(start, start + s - before.shape[1]).expand(keys.shape[1], -1)], 1
            )
            match = (new_keys[0][:, :, None, :] == keys[0][:, None, :, :]).all(-1)  # (Hkv, kept, S)
            assert bool((match.sum(-1) == 1).all()), "every kept key is exactly one of the keys given"
            kept = before.gather(1, match.float().argmax(-1))
            positions[layer] = kept
            while len(removed) <= step[0]:
                removed.append([[] for _ in range(layers)])
            removed[step[0]][layer] = [
                sorted(set(b.tolist()) - set(k.tolist())) for b, k in zip(before, kept)
            ]
            return new_keys, new_values

        return wrapper

    inner = [press.prefilling_press, press.decoding_press]
    for p in inner:
        object.__setattr__(p, "compress", tracked(p.compress))
    cache = DynamicCache()
    out = []
    with press(model):
        logits = model(input_ids=torch.tensor([ids[:PREFILL]]), past_key_values=cache).logits[0, -1]
        for i in range(STEPS):
            out.append(float(-torch.log_softmax(logits.float(), -1)[ids[PREFILL + i]]))
            if i == STEPS - 1:
                break
            step[0] = i + 1
            logits = model(
                input_ids=torch.tensor([[ids[PREFILL + i]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[PREFILL + i]]),
            ).logits[0, -1]
    for p in inner:
        del p.compress
    return out, removed


if __name__ == "__main__":
    sys.exit(main())
