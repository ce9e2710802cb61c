"""KVzap (arXiv 2601.07891): surrogate scores from the hidden states; threshold mode is kvpress's DMSPress
protocol (a pair below the threshold leaves once older than the window), ratio mode a scored eviction."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.loop import RunOptions, run
from kvlens.engine.scorers import LayerScorer
from kvlens.kvcache import HIDDEN, SCORER, Phase, Prompt, Step
from kvlens.policies import make_policy
from tests.conftest import kvlens, layer_rows, one_sentence, write_scorer

HKV, D, DM = 2, 4, 6
KEY = f"{SCORER}=auto"


def layer_with(scorer: LayerScorer, hidden: torch.Tensor):
    """A one-layer cache holding `hidden`'s T tokens `(T, DM)` at positions 0..T-1, with its scorer."""
    layer = layer_rows()
    t = hidden.shape[0]
    layer.append(torch.randn(1, HKV, t, D), torch.randn(1, HKV, t, D), torch.arange(t))
    layer.state[KEY], layer.state[HIDDEN] = scorer, hidden
    return layer


def kept(layer) -> list[set[int]]:
    return [set(layer.pos[h][layer.valid[h]].tolist()) for h in range(HKV)]


@pytest.mark.parametrize("seed", range(5))
def test_threshold_mode_keeps_exactly_the_window_and_the_pairs_that_pass_at_prefill_and_each_decode_step(
    seed,
):
    gen = torch.Generator().manual_seed(seed)
    scorer = LayerScorer(torch.randn(HKV, DM, generator=gen), torch.randn(HKV, generator=gen))
    t, window, threshold = 30, 6, 0.3
    hidden = torch.randn(t + 12, DM, generator=gen)  # the prompt's states, then 12 generated tokens'
    score = scorer(hidden)  # (Hkv, T + 12), the plain surrogate: W h + b
    policy = make_policy("kvzap", {"mode": "threshold", "window": window, "threshold": threshold})
    layer = layer_with(scorer, hidden[:t])
    policy.observe_prefill(layer, Prompt(torch.zeros(HKV, 0, t)))
    policy.compress(layer, Step(0, Phase.PREFILL, None))
    for step in range(13):
        seen = t + step  # positions 0 .. seen - 1 fed so far
        want = [
            {p for p in range(seen) if p >= seen - window or score[h, p] >= threshold} for h in range(HKV)
        ]
        assert kept(layer) == want, step
        if step == 12:
            break
        layer.append(torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D), torch.tensor([seen]))
        layer.state[HIDDEN] = hidden[seen : seen + 1]
        policy.compress(layer, Step(step + 1, Phase.DECODE, None))
    assert any(score[:, :seen].lt(threshold).sum(-1))  # something was pruned


def test_ratio_mode_keeps_each_heads_budget_of_best_surrogate_scores():
    gen = torch.Generator().manual_seed(7)
    scorer = LayerScorer(torch.randn(HKV, DM, generator=gen), torch.randn(HKV, generator=gen))
    hidden = torch.randn(20, DM, generator=gen)
    layer = layer_with(scorer, hidden)
    policy = make_policy("kvzap")
    policy.observe_prefill(layer, Prompt(torch.zeros(HKV, 0, 20)))
    policy.compress(layer, Step(0, Phase.PREFILL, 8))
    assert kept(layer) == [set(row.topk(8).indices.tolist()) for row in scorer(hidden)]


def test_ratio_mode_decoding_keeps_the_budgets_best_of_every_position_seen_also_those_fed_below_budget():
    gen = torch.Generator().manual_seed(8)
    scorer = LayerScorer(torch.randn(HKV, DM, generator=gen), torch.randn(HKV, generator=gen))
    hidden = torch.randn(22, DM, generator=gen)  # 10 prompt tokens, then 12 generated
    score, budget = scorer(hidden), 14  # the first 4 decode steps fit the budget: nothing leaves
    policy = make_policy("kvzap", {"mode": "ratio"})
    layer = layer_with(scorer, hidden[:10])
    policy.observe_prefill(layer, Prompt(torch.zeros(HKV, 0, 10)))
    policy.compress(layer, Step(0, Phase.PREFILL, budget))
    for seen in range(10, 22):
        layer.append(torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D), torch.tensor([seen]))
        layer.state[HIDDEN] = hidden[seen : seen + 1]
        policy.compress(layer, Step(seen - 9, Phase.DECODE, budget))
        want = [set(row[: seen + 1].topk(min(budget, seen + 1)).indices.tolist()) for row in score]
        assert kept(layer) == want, seen


def test_a_threshold_run_prunes_in_prefill_and_decoding_and_reports_per_head_counts_and_its_ratio(
    tiny, tmp_path
):
    """Head 0's surrogate scores every pair 1, head 1's -1: with threshold 0, head 0 keeps everything, head 1
    its window only, at every step and in every layer."""
    path = write_scorer(tiny, tmp_path / "constant.safetensors")
    from kvlens.engine import scorers

    layers = [LayerScorer(torch.zeros(2, 64), torch.tensor([1.0, -1.0])) for _ in range(3)]
    scorers.save(path, layers, tiny, {"fit": "[]", "command": "test"})
    ids, window = list(range(40, 140)), 16
    policy = make_policy(
        "kvzap", {"mode": "threshold", "threshold": 0.0, "window": window, "scorer": str(path)}
    )
    r = run(tiny, policy, ids, prefill=60, steps=20, teacher=True, opts=RunOptions())
    counts = r.tensors["steps/kv_slots"]  # (steps, L, Hkv)
    seen = torch.arange(60, 80)  # after step k the cache saw 60 + k positions
    assert torch.equal(counts[:, :, 0], seen[:, None].expand(20, 3).int())
    assert (counts[:, :, 1] == window).all()
    assert r.metrics["compression_ratio_final"] == pytest.approx(0.5 * (1 - window / 79))
    assert r.meta.budget.slots is None


@pytest.mark.slow
def test_the_shipped_scorer_drives_kvzap_on_the_embedded_model(smol, long_text):
    from kvlens.experiments.api import encode

    ids = encode(smol, long_text)[:300]
    r = run(
        smol,
        make_policy("kvzap", {"mode": "threshold"}),
        ids,
        prefill=280,
        steps=8,
        teacher=True,
        opts=RunOptions(),
    )
    assert 0 < r.metrics["compression_ratio_prompt"] < 1 and r.tensors["steps/nll"].isfinite().all()


@pytest.mark.slow
def test_a_missing_corrupt_or_foreign_scorer_is_refused_in_one_sentence_on_the_command_line(tmp_path, tiny):
    foreign = write_scorer(tiny, tmp_path / "tiny.safetensors")  # the embedded model runs here
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(foreign.read_bytes()[:100])
    cases = [
        (tmp_path / "none.safetensors", "There is no scorer file"),
        (foreign, "another model"),
        (corrupt, "not a readable scorer file"),
    ]
    for scorer, words in cases:
        args = [
            "--set",
            f"scorer={scorer}",
            "--budget",
            "0.5",
            "--prompt",
            "Hello there",
            "--max-new-tokens",
            "2",
        ]
        done = kvlens("generate", "--policy", "kvzap", *args, "--out", str(tmp_path / "run"))
        assert done.returncode == 2 and one_sentence(done.stderr) and words in done.stderr, done.stderr
