"""Quantized KV storage (`kvlens.kvcache.quantize`, KIVI): streaming equals KIVI's groups without eviction,
the full-precision window slides or flushes as the scheme says, reused slots and merges are stored again, the
bytes are the packed ones, and on the embedded model the policy's prompt decisions do not depend on the
storage."""

from __future__ import annotations

import pytest
import torch

from kvlens import texts
from kvlens.engine.loop import RunOptions
from kvlens.engine.shared_prefill import QUIET, answer, prepare
from kvlens.errors import KvlensError
from kvlens.experiments.api import perplexity
from kvlens.kvcache.kivi import QuantizedStates, seal
from kvlens.kvcache.quantize import Storage, dequantize, quantize
from kvlens.policies import make_policy

ALL = slice(0, 3)


def keys_like(n: int, seed: int = 0) -> torch.Tensor:
    """`(3, n, 64)` with a few outlier channels, as real keys have (KIVI Fig. 2)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(64)
    scale[[3, 17, 40]] = 12.0
    return torch.randn(3, n, 64, generator=g) * scale


def stream(storage: Storage, name: str, x: torch.Tensor, prompt: int) -> QuantizedStates:
    """Seal the first `prompt` tokens of `x`, then append the rest one at a time (no eviction)."""
    n = x.shape[1]
    pos = torch.arange(prompt).expand(3, prompt)
    states = seal(storage, name, x[:, :prompt], pos, torch.ones(3, prompt, dtype=torch.bool), n)
    for t in range(prompt, n):
        states.append(
            ALL,
            torch.full((3, 1), t),
            x[:, t : t + 1],
            torch.tensor([t]),
            torch.ones(3, t + 1, dtype=torch.bool),
        )
    return states


def test_without_eviction_streamed_keys_and_values_are_kivis_groups_exactly():
    """KIVI with R = G = 32: after 64 prompt + 64 streamed tokens (128 = 4 whole groups), keys are
    quantized per channel in the 4 groups of 32 consecutive tokens and values per token, exactly as
    quantizing at once."""
    storage = Storage(bits=2, scheme="kivi", group=32, residual=32)
    x = keys_like(128)
    keys, values = stream(storage, "keys", x, 64), stream(storage, "values", x, 64)
    assert not bool((keys.window_slot >= 0).any())  # 128 tokens: the keys' window has just flushed
    assert torch.equal(keys.read(ALL, 128), dequantize(*quantize(x, 2, 32, "slots"), 32, "slots", x.dtype))
    window = values.read(ALL, 128)
    assert torch.equal(window[:, 96:], x[:, 96:])  # the newest 32 values in full precision
    once = dequantize(*quantize(x, 2, 32, "channels"), 32, "channels", x.dtype)
    assert torch.equal(window[:, :96], once[:, :96])


def test_the_prompts_window_is_kivis_and_the_keys_window_flushes_a_group_at_a_time():
    storage = Storage(bits=4, scheme="kivi", group=16, residual=32)
    x = keys_like(120)
    keys, values = stream(storage, "keys", x, 100), stream(storage, "values", x, 100)
    # prompt 100 = 3 x 32 + 4: the last 4 keys and the last 32 values stayed in full precision, then 20 tokens
    # came: keys 4 + 20 = 24 < 32 still in the window; values slide, always the newest 32
    assert sorted(keys.window_pos[0][keys.window_slot[0] >= 0].tolist()) == list(range(96, 120))
    assert sorted(values.window_pos[0][values.window_slot[0] >= 0].tolist()) == list(range(88, 120))
    assert torch.equal(keys.read(ALL, 120)[:, 96:], x[:, 96:])
    more = stream(storage, "keys", keys_like(128), 100)  # 4 + 28 = 32: flushed as one block
    assert not bool((more.window_slot >= 0).any())


def test_a_reused_slot_takes_the_new_token_and_leaves_the_window_when_freed():
    storage = Storage(bits=4, scheme="token", group=32, residual=8)
    x = keys_like(40)
    states = stream(storage, "values", x, 32)
    assert 39 in states.window_pos[1].tolist()
    gone = torch.zeros(3, 40, dtype=torch.bool)
    gone[:, 39] = True  # slot 39 evicted while in the window
    states.forget(ALL, gone)
    assert 39 not in states.window_slot[1].tolist()
    new = keys_like(1, seed=5)
    states.append(ALL, torch.full((3, 1), 39), new, torch.tensor([40]), torch.ones(3, 40, dtype=torch.bool))
    assert torch.equal(states.read(ALL, 40)[:, 39], new[:, 0])


def test_a_changed_slot_is_quantized_again_and_its_group_keeps_its_other_codes():
    """A merge writes a new value into one slot: that slot reads back within a quantization step of it; the
    other slots of its per-channel group keep their values within rounding (re-quantizing is idempotent when
    the range holds), and other groups are untouched."""
    storage = Storage(bits=8, scheme="kivi", group=32, residual=0)
    x = keys_like(64)
    valid = torch.ones(3, 64, dtype=torch.bool)
    states = seal(storage, "keys", x, torch.arange(64).expand(3, 64), valid, 64)
    before = states.read(ALL, 64)
    merged = before.clone()
    merged[:, 5] = (before[:, 5] + before[:, 6]) / 2  # inside the group's range
    changed = torch.zeros(3, 64, dtype=torch.bool)
    changed[:, 5] = True
    states.write(ALL, merged, changed, valid)
    after = states.read(ALL, 64)
    step = states.scale.float()[:, 0] / 2 + 1e-3  # (3, 64): half a step per channel of group 0
    assert bool(((after[:, 5] - merged[:, 5]).abs() <= step).all())
    assert bool(
        ((after[:, :32] - before[:, :32]).abs()[:, [i for i in range(32) if i != 5]] <= step[:, None]).all()
    )
    assert torch.equal(after[:, 32:], before[:, 32:])


def test_bytes_are_the_packed_codes_the_float16_scales_and_the_window():
    storage = Storage(bits=2, scheme="kivi", group=64, residual=64)
    states = QuantizedStates(storage, "keys", 3, 100, 64, torch.float32, torch.device("cpu"))
    codes = 100 * 64 * 2 // 8
    scales = 2 * 64 * 2 * 2  # ceil(100 / 64) groups x 64 channels x (zero point, scale) x float16
    window = 64 * 64 * 4
    assert states.nbytes(3) == 3 * (codes + scales + window)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"bits": 3}, "--kv-bits"),
        ({"bits": 4, "scheme": "nf4"}, "--kv-scheme"),
        ({"bits": 4, "group": 32, "residual": 48}, "multiple"),
    ],
)
def test_bad_storage_settings_get_one_sentence(kwargs, words):
    with pytest.raises(KvlensError, match=words):
        Storage(**kwargs)


@pytest.mark.parametrize("along", ["slots", "channels"])
@pytest.mark.parametrize("base", [0.0, 100.03, -3001.3])
def test_a_narrow_group_far_from_zero_is_within_half_a_stored_step(base, along):
    """The float16 zero point rounds down and the scale up, so the grid covers the group's range: every value
    is within half a step (rounding both to nearest put 8-bit values near 100 up to 7.9 steps off)."""
    x = base + torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(1))
    for bits in (2, 8):
        codes, lo, scale = quantize(x, bits, 32, along)
        err = (dequantize(codes, lo, scale, 32, along, torch.float32) - x).abs()
        step = scale.float().repeat_interleave(32, dim=1 if along == "slots" else 2)
        assert (err <= step / 2 + 4 * torch.finfo(torch.float32).eps * x.abs()).all()  # + x's own rounding


def test_a_group_that_does_not_tile_the_head_is_refused_before_the_run(smol):
    with pytest.raises(KvlensError, match=r"--kv-group 48 does not divide the model's head size \(64\)"):
        perplexity(
            smol, "word " * 80, "full", prefill=40, tokens=4, opts=RunOptions(storage=Storage(4, group=48))
        )


@pytest.fixture(scope="module")
def kennedy():
    return texts.read("1961-Kennedy")


def test_four_and_two_bits_free_the_memory_and_keep_the_perplexity_close(smol, kennedy):
    """The packed cache really is smaller (4/32 plus scales; 2/32 plus scales) and 4 bits barely moves the
    perplexity, while 2 bits moves it more (measured 2-3 % and 30-45 % on the bundled texts)."""

    def go(storage):
        return perplexity(
            smol, kennedy, "full", prefill=256, tokens=32, opts=RunOptions(storage=storage)
        ).metrics

    full, four, two = go(Storage()), go(Storage(bits=4)), go(Storage(bits=2))
    assert four["kv_bytes_peak"] <= 0.15 * full["kv_bytes_peak"]
    assert two["kv_bytes_peak"] <= 0.085 * full["kv_bytes_peak"]
    assert abs(four["ppl"] / full["ppl"] - 1) < 0.05
    assert two["ppl"] > four["ppl"]


def test_the_prompts_decisions_do_not_depend_on_the_storage_and_eviction_adds_no_merging_error(smol, kennedy):
    """The policy chooses from the prompt in full precision, so the kept positions after step 0 are the same
    at any bits; a policy that never merges reports zero merging error, a merging one does not."""

    def go(policy, storage):
        return perplexity(
            smol,
            kennedy,
            policy,
            prefill=200,
            tokens=12,
            measure=True,
            opts=RunOptions(budget=0.5, storage=storage),
        )

    plain, packed = go("h2o", Storage()), go("h2o", Storage(bits=4))
    assert torch.equal(plain.tensors["steps/kv_slots"][0], packed.tensors["steps/kv_slots"][0])
    assert plain.decisions[plain.decisions["step"] == 0].equals(
        packed.decisions[packed.decisions["step"] == 0]
    )
    m = packed.metrics
    assert m["perturbation_sources"]["merging"] == 0 and m["merge_better_share"] == 0
    assert m["perturbation_sources"]["storage"] > 0
    assert "perturbation_sources" not in plain.metrics
    assert packed.meta.storage == Storage(bits=4).describe()
    cam = go("cam", Storage(bits=4)).metrics
    assert cam["perturbation_sources"]["merging"] != 0


def test_each_question_of_a_quantized_compressed_context_starts_from_it_afresh(smol, kennedy):
    """mark/rewind restore the quantized storage too (a flush quantizes tokens for good)."""
    ids = smol.tokenizer(kennedy, add_special_tokens=False).input_ids[:300]
    question = smol.tokenizer(
        "\n\nWhat did the president ask Congress for?", add_special_tokens=False
    ).input_ids
    opts = RunOptions(record="summary", log_decisions=False, storage=Storage(bits=4, group=32, residual=32))
    assert QUIET.storage == Storage()
    loop, _ = prepare(smol, make_policy("snapkv"), ids, 100, len(question) + 8, opts=opts)
    mark = loop.cache.mark()
    first = answer(loop, question, len(ids), 8)
    loop.cache.rewind(mark)
    assert answer(loop, question, len(ids), 8) == first


def test_the_frontier_plans_every_family_at_each_byte_budget_and_summarises_against_the_full_cache():
    from kvlens.experiments.bench import frontier

    cells = frontier.plan_frontier(
        [0.25, 0.125],
        {"a": "x " * 400},
        prefill=100,
        tokens=29,
        model="default",
        evictors=[("h2o", {})],
        mergers=[("cam", {})],
        bits=[4, 2],
        mix=("h2o", {}),
        mix_bits=[8, 4],
        storage=Storage(bits=4),
    )
    by = {
        (
            c["family"],
            c["policy"],
            c["budget"],
            (c["storage"] or {}).get("bits") or (c["storage"] or {}).get("rank_share"),
        )
        for c in cells
    }
    # 128 slots at the last step: 25 % = 32 slots, 12.5 % = 16; mixes at b / (bits / 32 + 1 / 64) of the
    # slots; low rank: every slot at byte share b (per head and xKV-4), h2o at sqrt(b) of the slots stored at
    # rank share sqrt(b), and every slot at byte share b with 4-bit coefficients
    assert by == {
        ("reference", "full", None, None),
        ("eviction", "h2o", 32, None),
        ("eviction", "h2o", 16, None),
        ("merging", "cam", 32, None),
        ("merging", "cam", 16, None),
        ("quantization", "full", None, 4),
        ("quantization", "full", None, 2),
        ("mix", "h2o", 120, 8),
        ("mix", "h2o", 60, 8),
        ("mix", "h2o", 114, 4),
        ("low_rank", "full", None, 0.25),
        ("low_rank", "full", None, 0.125),
        ("mix", "h2o", 64, 0.5),
        ("mix", "h2o", 45, 0.3536),
        ("mix", "full", None, 4),
    }
    assert (
        sorted(
            (c["storage"]["rank_layers"] or 0, c["storage"]["rank_append"])
            for c in cells
            if c["family"] == "low_rank"
        )
        == [(0, "full")] * 2 + [(0, "project")] * 2 + [(4, "full")] * 2
    )
    rows = [
        {
            **c,
            "budget_slots": c["budget"],
            "ppl": 10.0 if c["family"] == "reference" else 12.0,
            "kv_bytes_peak": 1000 if c["family"] == "reference" else 250,
        }
        for c in cells
    ]
    summary = frontier.summarise(rows)
    assert {s["family"] for s in summary} == {"reference", *frontier.FAMILIES}
    assert all(
        s["ppl_vs_full"] == pytest.approx(1.2) and s["bytes_share"] == 0.25
        for s in summary
        if s["family"] != "reference"
    )
    with pytest.raises(KvlensError, match="byte-shares"):
        frontier.plan_frontier(
            [1.5],
            {"a": "x"},
            prefill=10,
            tokens=2,
            model="default",
            evictors=[],
            mergers=[],
            bits=[],
            mix=None,
            mix_bits=[],
            storage=Storage(bits=4),
        )


def test_the_frontiers_task_cells_give_each_family_its_ratio_and_storage_and_score_against_the_full_cache():
    from kvlens.experiments.bench import frontier

    cells = frontier.plan_frontier_tasks(
        [0.25, 0.125],
        tasks=["niah_single"],
        lengths=[512],
        count=2,
        seed=0,
        source="s",
        model="default",
        evictors=[("h2o", {})],
        mergers=[("cam", {})],
        bits=[4],
        mix=("h2o", {}),
        mix_bits=[8],
        storage=Storage(bits=4),
    )
    plan = {
        (
            (c["storage"] or {}).get("bits") or (c["storage"] or {}).get("rank_share"),
            tuple(c["policies"]),
            tuple(round(r, 4) for r in c["ratios"]),
        )
        for c in cells
    }
    # model dtype: ratio 1 - b; 8 bits: the mix at 1 - b / (8 / 32 + 1 / 64) where that keeps under all slots;
    # low rank: the full cache at byte share b (per head twice, xKV, 4-bit coefficients), h2o at 1 - sqrt(b)
    # at rank share sqrt(b)
    assert plan == {
        (None, ("full", "h2o", "cam"), (0.75, 0.875)),
        (8, ("full", "h2o"), (0.0588, 0.5294)),
        (4, ("full",), ()),
        (0.25, ("full",), ()),
        (0.125, ("full",), ()),
        (0.5, ("full", "h2o"), (0.5,)),
        (0.3536, ("full", "h2o"), (0.6464,)),
    }
    assert len(cells) == 26  # two samples of each: 3 cells, and 5 per byte share

    def result(policy, ratio, score, kv_bytes):
        return {"policy": policy, "ratio": ratio, "score": score, "kv_bytes": kv_bytes}

    rows = []
    for c in cells:
        bits = (c["storage"] or {}).get("bits") or (c["storage"] or {}).get("rank_share")
        full = result(
            "full", 0.0, 1.0, {None: 1000, 8: 266, 4: 141, 0.25: 250, 0.125: 125, 0.5: 500, 0.3536: 354}[bits]
        )
        rest = [
            result(p, r, float(c["index"]), 1000 * (1 - r) * (0.265625 if bits else 1))
            for p in c["policies"][1:]
            for r in c["ratios"]
        ]
        rows.append({**c, "results": [full, *rest]})
    summary = {(s["family"], s["config"]): s for s in frontier.summarise(rows)}
    assert summary[("reference", "full")]["bytes_share"] == 1.0
    assert summary[("quantization", "all slots @ 4 bits")]["bytes_share"] == pytest.approx(0.141)
    assert summary[("merging", "cam r=0.75")]["target"] == 0.25
    low = summary[("low_rank", "all slots, low rank per head at 0.25 of its bytes")]
    assert low["target"] == 0.25 and low["bytes_share"] == pytest.approx(0.25) and low["score"] == 1.0
    assert summary[("low_rank", "all slots, xKV low rank, 4 layers at 0.25 of its bytes")]["target"] == 0.25
    assert (
        summary[("low_rank", "all slots, low rank per head, full-width new tokens at 0.25 of its bytes")][
            "target"
        ]
        == 0.25
    )
    ranked = summary[("mix", "h2o r=0.5, low rank per head at 0.5 of its bytes")]
    assert ranked["target"] == 0.25 and ranked["score"] == 0.5
    assert (
        summary[("mix", "all slots, low rank per head at 0.125 of its bytes @ 4-bit coefficients")]["target"]
        == 0.125
    )
    mix = summary[("mix", "h2o r=0.0588 @ 8 bits")]
    assert mix["target"] == 0.25 and mix["bytes_share"] == pytest.approx(0.25) and mix["score"] == 0.5
    assert mix["samples"] == 2 and mix["full_score"] == 1.0 and mix["metric"] == "score"
