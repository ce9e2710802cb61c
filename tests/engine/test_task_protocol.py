"""The task suite's compress-once protocol (`kvlens.engine.shared_prefill`): a shared prefill gives each
policy exactly its own run's decisions and answers; a question fed as one chunk equals the model's own
forward; several questions of one compressed context each start from it afresh."""

from __future__ import annotations

import pytest
import torch

from kvlens import texts
from kvlens.engine.shared_prefill import SharedPrefill, answer, prepare
from kvlens.policies import make_policy

# both prefill kernels (SDPA; the eager column-sum pass), last rows of several counts, per-head padding
# (Ada-KV), per-layer budgets (PyramidKV), replay passes (KVzip), merging (CaM), a budget-free policy (CORM),
# the hidden states entering each attention layer (KVzap)
POLICIES = [
    "full",
    "snapkv",
    "h2o",
    "tova",
    "adakv",
    "pyramidkv",
    "kvzip",
    "cam",
    "corm",
    "expected_attention",
    "kvzap",
]


def kept_positions(loop) -> list[torch.Tensor]:
    """Each layer's kept positions per KV head, sorted (-1 for padding)."""
    return [torch.sort(torch.where(v.valid, v.pos, -1), -1).values for v in loop.cache.layers]


@pytest.fixture(scope="module")
def context_question(smol):
    ids = smol.tokenizer(texts.read("1961-Kennedy"), add_special_tokens=False).input_ids
    question = smol.tokenizer(
        "\n\nWhat did the president ask Congress for? Answer in one sentence.", add_special_tokens=False
    ).input_ids
    return ids[:300], question


def test_a_shared_prefill_gives_every_policy_its_own_runs_decisions_and_answers(smol, context_question):
    context, question = context_question
    shared = SharedPrefill(smol, context, [make_policy(n) for n in POLICIES])
    assert sorted(shared.groups) == [False, True]  # SDPA for some, the eager statistics pass for others
    runs = [(n, b) for n in POLICIES for b in ([None] if make_policy(n).budget_free else [120, 60])]
    for name, budget in runs:  # a second budget: what the replay passes left is copied, not recomputed
        own, own_logits = prepare(smol, make_policy(name), context, budget, len(question) + 8)
        mine, logits = prepare(smol, make_policy(name), context, budget, len(question) + 8, shared=shared)
        for a, b in zip(kept_positions(own), kept_positions(mine), strict=True):
            assert torch.equal(a, b), name
        assert torch.equal(own_logits, logits), name
        own_tokens, own_nlls = answer(own, question, len(context), 8)
        tokens, nlls = answer(mine, question, len(context), 8)
        assert tokens == own_tokens, name
        assert nlls == pytest.approx(own_nlls, rel=1e-5, abs=1e-6), name


def test_a_question_fed_as_one_chunk_equals_the_models_forward_and_token_by_token(smol, context_question):
    """Full cache: the chunk's last logits are the model's own (transformers' SDPA, no kvlens context) within
    float rounding, and the same as feeding the question one token at a time."""
    context, question = context_question
    loop, _ = prepare(smol, make_policy("full"), context, None, len(question) + 1)
    mark = loop.cache.mark()
    with torch.inference_mode():
        chunk = loop.forward(question, len(context))
        loop.cache.rewind(mark)
        for i, token in enumerate(question):
            single = loop.forward([token], len(context) + i)
        reference = smol.model(torch.tensor([context + question], device=smol.device)).logits[0, -1]
    torch.testing.assert_close(chunk, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk, single, rtol=1e-4, atol=1e-4)


def test_each_question_of_a_compressed_context_starts_from_it_afresh(smol, context_question):
    """mark/rewind: the second question's answer is the one a freshly compressed cache gives, and the
    cache holds the budget again after each rewind (per-head padding included; KVzip leaves layers where
    some heads have a freed slot and others none, so a decode token grows the layer by a slot that must be
    free again)."""
    context, question = context_question
    other = smol.tokenizer("\n\nName one country the speech mentions.", add_special_tokens=False).input_ids
    for name in ("snapkv", "adakv", "kvzip"):
        loop, _ = prepare(smol, make_policy(name), context, 100, len(question) + 8)
        before = kept_positions(loop)
        mark = loop.cache.mark()
        answer(loop, question, len(context), 8)
        loop.cache.rewind(mark)
        assert all(torch.equal(a, b) for a, b in zip(before, kept_positions(loop), strict=True))
        second = answer(loop, other, len(context), 8)
        fresh, _ = prepare(smol, make_policy(name), context, 100, len(question) + 8)
        assert answer(fresh, other, len(context), 8) == second


def test_a_frozen_cache_never_asks_the_policy_again(smol, context_question):
    """After the prompt's compression nothing is evicted: the cache grows by exactly the tokens fed."""
    context, question = context_question
    loop, _ = prepare(smol, make_policy("h2o"), context, 64, len(question) + 6)
    tokens, _ = answer(loop, question, len(context), 6)
    fed = len(question) + len(tokens) - 1  # the last answer token is never fed
    assert [int(v.valid.sum(-1).max()) for v in loop.cache.layers] == [64 + fed] * len(loop.cache.layers)


def test_answers_from_many_caches_at_once_equal_each_caches_own(smol, context_question):
    """`answer_many` stacks every policy's compressed cache (per-head padding, per-layer budgets, merged
    values, the full prompt) as one batch: each row's greedy tokens are its cache's own and their NLLs equal
    within float rounding, with a question chunk and without one (the prompt's logits), and with rows leaving
    the batch early (`done` stops the three widest caches after 3 tokens; compaction then drops them, and the
    padding that only they needed)."""
    from kvlens.engine.batch_answer import answer_many

    context, question = context_question
    shared = SharedPrefill(smol, context, [make_policy(n) for n in POLICIES])
    loops, logits = [], []
    for name in POLICIES:
        budget = None if make_policy(name).budget_free else 120
        loop, last = prepare(smol, make_policy(name), context, budget, len(question) + 12, shared=shared)
        loops.append(loop)
        logits.append(last)
    widths = [max(layer.n_slots for layer in loop.cache.layers) for loop in loops]
    wide = sorted(range(len(loops)), key=lambda i: -widths[i])[:3]
    assert widths[wide[2]] > sorted(widths)[-4]  # so dropping them shortens the batch
    for q, start_logits in [(question, None), ([], logits)]:
        got = answer_many(
            loops,
            q,
            len(context),
            12,
            start_logits,
            done=lambda row, tokens: row in wide and len(tokens) == 3,
        )
        for i, (name, loop) in enumerate(zip(POLICIES, loops, strict=True)):
            mark = loop.cache.mark()
            tokens, nlls = answer(loop, q, len(context), 3 if i in wide else 12, None if q else logits[i])
            loop.cache.rewind(mark)
            assert got[i][0] == tokens, name
            assert got[i][1] == pytest.approx(nlls, rel=1e-4, abs=1e-5), name


def test_a_compacted_batch_drops_the_padding_only_the_dropped_caches_needed():
    """`_BatchLayer.keep`: dropping the widest cache moves the fed tokens up behind the longest remaining one;
    each remaining row still holds exactly its own slots and the fed tokens, nothing stale where they were."""
    from kvlens.engine.batch_answer import _BatchLayer

    def part(n):  # one cache's layer: 1 KV head, n slots holding positions 0..n-1, key = position
        pos = torch.arange(n)[None]
        return pos[..., None].float(), pos[..., None].float(), torch.ones(1, n, dtype=torch.bool), pos

    layer = _BatchLayer([part(9), part(3), part(5)], room=8)
    for step, position in enumerate((20, 21)):  # two fed tokens, as `attend` appends them
        at = layer.n
        layer.keys[:, :, at], layer.valid[:, :, at], layer.pos[:, :, at] = 100 + step, True, position
        layer.n = at + 1
    layer.keep(torch.tensor([1, 2]))
    assert (layer.base, layer.n, layer.keys.shape[2]) == (5, 7, 5 + 8)
    for row, own in enumerate((3, 5)):
        kept = layer.valid[row, 0]
        assert layer.pos[row, 0][kept].tolist() == [*range(own), 20, 21]
        assert layer.keys[row, 0, 5:7, 0].tolist() == [100, 101] and not kept[7:].any()


@pytest.mark.parametrize("rounding, kept", [("kvpress", 150), ("kvlens", 151)])
def test_a_ratio_keeps_kvpress_or_kvlens_rounded_count_on_an_odd_context(
    smol, context_question, rounding, kept
):
    """0.5 of 301 tokens: kvpress keeps int(301 * 0.5) = 150 (its `n_kept`), kvlens's earlier rounding 301 -
    150; StreamingLLM keeps its 4 sinks and the newest rest, in every layer and head."""
    from kvlens.engine.shared_prefill import slots_for

    context = context_question[0] + context_question[1][:1]  # 301 tokens
    assert len(context) == 301 and slots_for(0.5, 301, rounding) == kept
    loop, _ = prepare(
        smol, make_policy("streaming_llm", {"sink": 4}), context, slots_for(0.5, 301, rounding), 8
    )
    expected = torch.tensor([0, 1, 2, 3, *range(301 - (kept - 4), 301)])
    for layer in kept_positions(loop):
        assert all(torch.equal(head[head >= 0], expected) for head in layer)  # -1: a buffer's padding


def test_roundings_differ_only_where_the_kept_share_is_not_whole():
    from kvlens.engine.shared_prefill import slots_for
    from kvlens.errors import KvlensError

    assert [slots_for(r, 1000) for r in (0.25, 0.5, 0.75, 0.875)] == [750, 500, 250, 125]
    assert [slots_for(r, 1000, "kvlens") for r in (0.25, 0.5, 0.75, 0.875)] == [750, 500, 250, 125]
    assert [slots_for(r, 1001) for r in (0.25, 0.5, 0.875)] == [750, 500, 125]  # int(1001 * (1 - r))
    assert [slots_for(r, 1001, "kvlens") for r in (0.25, 0.5, 0.875)] == [
        751,
        501,
        126,
    ]  # 1001 - int(1001 * r)
    with pytest.raises(KvlensError, match="Unknown rounding 'up'"):
        slots_for(0.5, 10, "up")
