"""ThinK's channel-pruned keys (`kvlens.policies.think`, `kvlens.kvcache.channels`): what is stored, its
bytes, and the refusals. Its channel choice against kvpress is in
`tests/cross_checks/test_kvpress_crosscheck.py`."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.attention import decode_channels, decode_rows
from kvlens.engine.loop import RunOptions, new_loop, run
from kvlens.errors import KvlensError
from kvlens.kvcache.cache import KVCache
from kvlens.kvcache.channels import seal_channels
from kvlens.kvcache.quantize import Storage
from kvlens.kvcache.scores import AttentionSpec
from kvlens.policies import make_policy, parse_settings

IDS = list(b"Thinner keys: the channels the last queries weigh least leave every key of the prompt. " * 2)
PREFILL, BUDGET = 80, 24


def prompt_cache(model, name: str, params: dict):
    """The cache right after the prompt's compression."""
    loop = new_loop(model, make_policy(name, params), RunOptions(budget=BUDGET), [], PREFILL, PREFILL + 4)
    with torch.inference_mode():
        loop.prefill(IDS[:PREFILL])
    return loop.cache


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_the_pruned_share_of_key_bytes_leaves_the_cache(tiny, ratio):
    """Against the same eviction without ThinK: the bytes drop by the pruned channels of every kept key, less
    the channel indices each head stores; values and positions are the same."""
    base = {"base.window": 8, "window": 8, "ratio": ratio, "recent": 0}
    think = prompt_cache(tiny, "think", base)
    snapkv = prompt_cache(tiny, "snapkv", {"window": 8})
    shape = tiny.shape()
    d, rows = shape["head_dim"], shape["layers"] * shape["kv_heads"]
    pruned, slots = int(d * ratio), BUDGET + 3  # each head's buffers: the budget and the 3 tokens to come
    assert snapkv.nbytes - think.nbytes == rows * (slots * pruned * 4 - d * 8)  # float32 keys, long indices
    for mine, theirs in zip(think.layers, snapkv.layers, strict=True):
        assert torch.equal(mine.pos, theirs.pos) and torch.equal(mine.values, theirs.values)
        kept = mine.store.packed["keys"].channels[mine.rows]  # (Hkv, K)
        assert kept.shape[1] == d - pruned
        gone = torch.ones(kept.shape[0], d, dtype=torch.bool).scatter_(1, kept, False)
        keys = mine.keys[0]
        assert not keys[gone[:, None, :].expand_as(keys)].any()  # the pruned channels read as zero
        assert torch.equal(
            keys.gather(2, kept[:, None, :].expand(-1, keys.shape[1], -1)),
            theirs.keys[0].gather(2, kept[:, None, :].expand(-1, keys.shape[1], -1)),
        )


def test_think_alone_prunes_the_whole_prompt_and_the_run_records_the_channels(tiny):
    """Over `full` (kvpress's ThinKPress alone): no budget, every prompt key pruned (`recent=0`); the run's
    `kv_channels` are the stored ones."""
    params = {"base": "full", "window": 8, "ratio": 0.5, "recent": 0}
    think, full = prompt_cache(tiny, "think", params), prompt_cache(tiny, "full", {})
    shape = tiny.shape()
    d, rows = shape["head_dim"], shape["layers"] * shape["kv_heads"]
    assert full.nbytes - think.nbytes == rows * (PREFILL * d // 2 * 4 - d * 8)
    r = run(
        tiny, make_policy("think", params), IDS, prefill=PREFILL, steps=4, teacher=True, opts=RunOptions()
    )
    stored = torch.stack([layer.store.packed["keys"].channels[layer.rows] for layer in think.layers])
    assert torch.equal(r.tensors["kv_channels"], stored.int()) and r.tensors["kv_channels"].shape[2] == d // 2


def test_the_newest_prompt_keys_and_later_tokens_keep_every_channel():
    """`recent` slots and appended tokens are read back whole; the others on their kept channels only; a freed
    slot gives its whole-key entry back."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, generator=gen)
    channels = torch.tensor([[0, 2, 5], [1, 6, 7]])
    whole = torch.zeros(2, 6, dtype=torch.bool)
    whole[:, 4:] = True
    states = seal_channels(channels, x, torch.ones(2, 6, dtype=torch.bool), whole, capacity=8)
    mask = torch.zeros(2, 1, 8, dtype=torch.bool).scatter_(2, channels[:, None, :], True)
    assert torch.equal(states.read(slice(0, 2), 6), torch.where(mask | whole[..., None], x, 0))
    new = torch.randn(2, 1, 8, generator=gen)
    states.append(
        slice(0, 2), torch.tensor([[6], [6]]), new, torch.tensor([6]), torch.ones(2, 7, dtype=torch.bool)
    )
    assert torch.equal(states.read(slice(0, 2), 7)[:, 6], new[:, 0])
    gone = torch.zeros(2, 7, dtype=torch.bool)
    gone[:, 4] = True
    states.forget(slice(0, 2), gone)
    assert not states.in_window(slice(0, 2), 7)[:, 4].any() and states.in_window(slice(0, 2), 7)[:, 5:].all()


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_decode_step_attends_on_the_kept_channels_as_on_the_keys_read_back(softcap):
    """`decode_channels` (the logits on each row's kept channels, plus a whole key's pruned ones, no key
    rebuilt) gives `decode_rows`' output on the keys `read` rebuilds, with a padding slot hidden and a freed
    whole-key entry left out."""
    gen = torch.Generator().manual_seed(1)
    hkv, g, n, d = 2, 3, 7, 8
    x = torch.randn(hkv, n, d, generator=gen)
    whole = torch.zeros(hkv, n, dtype=torch.bool)
    whole[:, 3:] = True
    states = seal_channels(
        torch.tensor([[0, 2, 5], [1, 6, 7]]), x, torch.ones(hkv, n, dtype=torch.bool), whole, 8
    )
    gone = torch.zeros(hkv, n, dtype=torch.bool)
    gone[0, 4] = True  # its whole-key entry becomes empty (-1)
    states.forget(slice(0, hkv), gone)
    valid = ~gone
    query, value = torch.randn(1, hkv * g, 1, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
    spec = AttentionSpec(scaling=0.4, softcap=softcap)
    rows = slice(0, hkv)
    expected = decode_rows(query, states.read(rows, n)[None], value, valid, spec)[0]
    assert torch.allclose(decode_channels(query, states, rows, value, valid, spec), expected, atol=1e-6)


def test_decode_steps_read_the_pruned_keys_in_place_with_the_rebuilt_keys_losses(tiny, monkeypatch):
    """In a run, each decode step's attention reads the channel-pruned keys where they lie
    (`KVCache.reads_channels`); its losses are those of attention over the keys `read` rebuilds."""

    def losses():
        r = run(
            tiny,
            make_policy("think", {"base.window": 8}),
            IDS,
            prefill=PREFILL,
            steps=6,
            teacher=True,
            opts=RunOptions(budget=BUDGET),
        )
        return r.tensors["steps/nll"]

    in_place = []
    reads = KVCache.reads_channels
    monkeypatch.setattr(
        KVCache, "reads_channels", lambda self, layer: in_place.append(reads(self, layer)) or in_place[-1]
    )
    fast = losses()
    monkeypatch.setattr(KVCache, "reads_channels", lambda self, layer: None)
    decode_steps = 5  # the first token comes from the prompt's forward
    assert sum(s is not None for s in in_place) == 2 * tiny.shape()["layers"] * decode_steps  # update, attend
    assert torch.allclose(fast, losses(), atol=1e-5)


def test_think_runs_over_other_evictions_and_keeps_their_decisions(tiny):
    """ThinK changes what a key holds, never which slots an eviction keeps when the channels do not decide
    it."""
    for base in ("h2o", "streaming_llm"):
        think = run(
            tiny,
            make_policy("think", {"base": base}),
            IDS,
            prefill=PREFILL,
            steps=4,
            teacher=True,
            opts=RunOptions(budget=BUDGET),
        )
        alone = run(
            tiny,
            make_policy(base),
            IDS,
            prefill=PREFILL,
            steps=4,
            teacher=True,
            opts=RunOptions(budget=BUDGET),
        )
        assert think.decisions[think.decisions.step == 0].equals(alone.decisions[alone.decisions.step == 0])
        assert think.tensors["steps/nll"].isfinite().all()


@pytest.mark.parametrize("settings", [["ratio=1"], ["ratio=1.5"], ["ratio=-0.1"], ["window=0"]])
def test_a_bad_setting_gets_one_sentence(settings):
    with pytest.raises(KvlensError) as err:
        make_policy("think", parse_settings("think", settings))
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_channel_pruned_keys_do_not_combine_with_packed_storage(tiny):
    with pytest.raises(KvlensError, match="does not combine with quantized or low-rank storage"):
        run(
            tiny,
            make_policy("think"),
            IDS,
            prefill=PREFILL,
            steps=2,
            teacher=True,
            opts=RunOptions(budget=BUDGET, storage=Storage(bits=4, group=16)),
        )
