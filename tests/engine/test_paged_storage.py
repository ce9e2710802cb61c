"""Paged storage (`kvlens.kvcache.paged`): a layer whose heads keep different counts holds pages for its kept
slots only (bytes = the pool's pages, the zero page included, x PAGE x (K + V) x D x dtype size), and its
decisions and tokens are the padded layout's."""

from __future__ import annotations

import pytest
import torch

import kvlens.engine.loop as loop_module
from kvlens.engine.attention import decode_rows, decode_segments
from kvlens.engine.loop import RunOptions, run
from kvlens.kvcache import AttentionSpec, frees, paged
from kvlens.kvcache.cache import KVCache
from kvlens.kvcache.paged import PAGE, PagedStore
from kvlens.kvcache.quantize import Storage
from kvlens.kvcache.store import GROWTH, HOLES
from kvlens.policies import make_policy
from kvlens.texts import prefix_ids

N, D = 32, 4  # the unit tests' prompt: 2 KV heads x 32 slots of width 4 (float32)
UNIT_PAGE = 8  # the unit tests count slots in pages of 8 (`pages_of_8`), whatever the default `PAGE`
PAGE_BYTES = UNIT_PAGE * 2 * D * 4  # one page of keys and one of values


@pytest.fixture
def pages_of_8(monkeypatch):
    """The store's pages hold `UNIT_PAGE` slots for this test."""
    monkeypatch.setattr(paged, "PAGE", UNIT_PAGE)


def paged_layer(limit: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A one-layer paged cache after its prompt's compression: head 0 keeps positions 20..31 (12 slots), head
    1 positions 4..31 (28 slots); also the prompt's keys and values `(1, 2, N, D)`."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, N, D, generator=g), torch.randn(1, 2, N, D, generator=g)
    cache = KVCache(1, limit=limit, paged=True)
    with cache.feeding(torch.arange(N)):
        cache.update(keys, values, 0)
    gone = torch.tensor([list(range(20)), [0, 1, 2, 3] + [-1] * 16])
    cache.layers[0].free(gone)
    return cache, keys, values


def append(cache: KVCache, position: int, value: float) -> None:
    """One decode token at `position` whose keys and values are all `value`."""
    x = torch.full((1, 2, 1, D), value)
    with cache.feeding(torch.tensor([position])):
        cache.update(x, x, 0)


@pytest.mark.usefixtures("pages_of_8")
@pytest.mark.parametrize("limit", [29, 64], ids=["outgrown", "within-limit"])
def test_uneven_heads_hold_pages_for_their_kept_slots_only(limit):
    cache, keys, values = paged_layer(limit)
    layer = cache.layers[0]
    store = layer.store
    assert isinstance(store, PagedStore)
    capacity = max(limit, 28)
    assert layer.valid.tolist() == [
        [True] * 12 + [False] * (capacity - 12),
        [True] * 28 + [False] * (capacity - 28),
    ]
    assert layer.pos[0, :12].tolist() == list(range(20, 32)) and layer.pos[1, :28].tolist() == list(
        range(4, 32)
    )
    pages = -(-12 // UNIT_PAGE) + -(-28 // UNIT_PAGE)
    assert int((store.table >= 0).sum()) == pages == store.pools["keys"].shape[0] - 1  # page 0: zeros
    assert cache.nbytes == (pages + 1) * PAGE_BYTES
    assert torch.equal(layer.keys[0, 0, :12], keys[0, 0, 20:]) and torch.equal(
        layer.keys[0, 1, :28], keys[0, 1, 4:]
    )
    assert torch.equal(layer.values[0, 0, :12], values[0, 0, 20:])
    assert not layer.keys[0, 0, 12:].any()  # padding has no page: it reads zeros


@pytest.mark.usefixtures("pages_of_8")
def test_a_page_left_without_a_valid_slot_stays_until_a_token_refills_it():
    cache, _, _ = paged_layer(29)
    layer, store = cache.layers[0], cache.layers[0].store
    assert isinstance(store, PagedStore)
    page = int(store.table[0, 1])
    layer.free(torch.tensor([[8, 9, 10, 11], [-1] * 4]))  # head 0's second page: slots 8..11 were its last
    assert int(store.table[0, 1]) == page and not store.spare and cache.nbytes == 7 * PAGE_BYTES
    append(cache, N, 5.0)  # head 0's lowest free slot is 8, in that page
    assert int(store.table[0, 1]) == page and not store.spare
    assert layer.pos[0, 8].item() == N and layer.keys[0, 0, 8].eq(5.0).all()
    assert int(layer.pos[1, 28]) == N  # head 1's next slot after its kept ones, in its fourth page
    assert store.pools["keys"].shape[0] == 7


@pytest.mark.usefixtures("pages_of_8")
def test_a_page_needed_reclaims_one_left_without_a_valid_slot_before_the_pool_grows():
    cache, _, _ = paged_layer(64)
    layer, store = cache.layers[0], cache.layers[0].store
    assert isinstance(store, PagedStore)
    emptied = int(store.table[0, 1])
    layer.free(torch.tensor([list(range(12)), [-1] * 12]))  # head 0 keeps nothing; its two pages stay
    for step in range(5):  # head 0 refills slots 0..4 (its first page); head 1 fills 28..31, then 32
        append(cache, N + step, float(step))
    assert store.pools["keys"].shape[0] == 7 and not store.spare  # head 0's emptied page, not a new one
    assert int(store.table[0, 1]) == -1 and int(store.table[1, 4]) == emptied
    assert layer.pos[0, :5].tolist() == list(range(N, N + 5)) and int(layer.pos[1, 32]) == N + 4
    assert layer.keys[0, 1, 32].eq(4.0).all() and layer.keys[0, 0, 4].eq(4.0).all()


@pytest.mark.usefixtures("pages_of_8")
def test_a_new_page_grows_the_pool_by_a_page_per_row_and_rewind_releases_it():
    cache, keys, _ = paged_layer(64)
    layer, store = cache.layers[0], cache.layers[0].store
    assert isinstance(store, PagedStore)
    layer.free(torch.tensor([[-1], [4]]))  # head 1's tokens go into slots 4, 28..31: no new page
    mark = cache.mark()
    for step in range(5):  # head 0 fills slots 12..16: slot 16 opens its third page
        append(cache, N + step, float(step))
    assert layer.pos[1, 4].item() == N and int(layer.pos[0, 16]) == N + 4
    assert store.pools["keys"].shape[0] == 7 + 2 and int((store.table >= 0).sum()) == 7
    assert cache.nbytes == 9 * PAGE_BYTES
    cache.rewind(mark)
    assert int((store.table >= 0).sum()) == 6 and len(store.spare) == 2
    assert torch.equal(layer.keys[0, 0, :12], keys[0, 0, 20:]) and layer.valid.sum(-1).tolist() == [12, 27]


@pytest.mark.usefixtures("pages_of_8")
def test_what_a_policy_merges_into_the_working_copy_is_committed():
    cache, _, values = paged_layer(29)
    layer = cache.layers[0]
    layer.values = layer.values * 2
    cache.commit()
    assert torch.equal(layer.values[0, 1, :28], values[0, 1, 4:] * 2)
    assert not layer.values[0, 0, 12:].any()  # padding slots stay without a page


@pytest.mark.usefixtures("pages_of_8")
def test_reserve_lays_each_head_out_in_one_segment_with_room_for_the_tokens_to_come():
    """After `reserve(5)` head 0 (12 kept) holds 17 slots on 3 pages and head 1 (28 kept) 33 on 5, one run of
    the pool each after the zero page: 9 pages of bytes; the kept keys and values are unchanged; the 5 tokens
    fill each head's next slots on those pages (no page allocated, the layout kept), and so do 7 more (head
    0's third page is full at 24 slots); a 13th token leaves the layout."""
    cache, keys, values = paged_layer(29)
    layer, store = cache.layers[0], cache.layers[0].store
    assert isinstance(store, PagedStore)
    cache.reserve(5)
    assert store.segments == [(1 * UNIT_PAGE, 3), (4 * UNIT_PAGE, 5)] and cache.nbytes == 9 * PAGE_BYTES
    assert torch.equal(store.segment("keys", 0, 12), keys[0, 0, 20:])
    assert torch.equal(store.segment("values", 1, 28), values[0, 1, 4:])
    for step in range(5):
        append(cache, N + step, float(step + 1))
    assert store.segments is not None and store.pools["keys"].shape[0] == 9
    assert layer.valid.sum(-1).tolist() == [17, 33] and layer.pos[0, 12:17].tolist() == list(range(N, N + 5))
    assert torch.equal(store.segment("keys", 0, 17)[12:, 0], torch.arange(1.0, 6.0))
    assert torch.equal(layer.keys[0, 1, :33], store.segment("keys", 1, 33))
    for step in range(5, 12):
        append(cache, N + step, float(step + 1))
    assert store.segments is not None and layer.valid.sum(-1).tolist() == [24, 40]
    append(cache, N + 12, 13.0)  # head 0's 25th slot needs a page outside its segment
    assert store.segments is None and layer.valid.sum(-1).tolist() == [25, 41]
    assert torch.equal(layer.keys[0, 0, :25, 0], torch.cat([keys[0, 0, 20:, 0], torch.arange(1.0, 14.0)]))


@pytest.mark.usefixtures("pages_of_8")
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_on_the_segments_is_attention_over_the_gathered_slots(softcap):
    """`decode_segments` (each head's keys and values read in place) gives `decode_rows`'s output on the
    gathered slots, with GQA and soft-capping; a run's cache hands such a layer's attention no keys or
    values at a decode step, only in a forward whose attention reads them in place (`in_place`)."""
    cache, _, _ = paged_layer(29)
    layer, store = cache.layers[0], cache.layers[0].store
    cache.reserve(3)
    append(cache, N, 0.25)
    query = torch.randn(1, 4, 1, D, generator=torch.Generator().manual_seed(1))  # 2 query heads per KV head
    spec = AttentionSpec(scaling=0.5, softcap=softcap)
    counts = layer.valid.sum(-1).tolist()
    want = decode_rows(query, layer.keys, layer.values, layer.valid, spec)[0]
    got = decode_segments(query, store, layer.rows, counts, spec)
    assert counts == [13, 29] and torch.allclose(got, want, atol=1e-6)
    x = torch.full((1, 2, 1, D), 0.5)
    assert cache.reads_pages(layer) is None  # the run's attention reads rows: keys and values gathered
    with cache.feeding(torch.tensor([N + 1])):
        k, v = cache.update(x, x, 0)
    assert k.shape[2] == v.shape[2] == layer.valid.shape[1]
    with cache.feeding(torch.tensor([N + 2]), in_place=True):
        k, v = cache.update(x, x, 0)
        assert cache.reads_pages(layer) is store
    assert k.shape[2] == v.shape[2] == 0 and cache.reads_pages(layer) is None


def test_the_all_layer_store_is_never_paged():
    assert not any(book.paged for book in KVCache(2, limit=8, all_layers=True, paged=True).books)


class Padded(KVCache):
    """The engine's cache with paging off: the padded layout to compare with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "paged": False})


def remembered(made: list[KVCache]) -> type[KVCache]:
    """The engine's cache, each one made appended to `made`, so a test can read its layout after the run."""

    class Kept(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    return Kept


STRUCTURAL = ["step", "layer", "kv_head", "action", "position"]


def assert_same_decisions(a_run, b_run) -> None:
    """Both runs made the same decision rows (some), whatever slot order they were logged in."""
    a, b = (r.decisions[STRUCTURAL].sort_values(STRUCTURAL).reset_index(drop=True) for r in (a_run, b_run))
    assert len(a) > 0 and a.equals(b)


def assert_same_kept(cache: KVCache, other: KVCache) -> None:
    """Every layer's heads keep the same positions in both caches, in whatever slots."""
    for new, was in zip(cache.layers, other.layers, strict=True):
        for head in range(new.pos.shape[0]):
            assert torch.equal(
                new.pos[head][new.valid[head]].sort().values, was.pos[head][was.valid[head]].sort().values
            )


def corm_run(smol, ids: list[int], monkeypatch, storage: Storage | None = None) -> tuple[object, KVCache]:
    """CORM (window and recent 4) teacher-forced for 12 steps after a 200-token prompt, and its cache."""
    made: list[KVCache] = []
    monkeypatch.setattr(loop_module, "KVCache", remembered(made))
    r = run(
        smol,
        make_policy("corm", {"window": 4, "recent": 4}),
        ids,
        prefill=200,
        steps=12,
        teacher=True,
        opts=RunOptions(record="summary", storage=storage or Storage()),
    )
    (cache,) = made
    return r, cache


@pytest.mark.parametrize(
    "name,params",
    [("adakv", {"base.decoding": "rolling"}), ("kvzip", {"decoding": "rolling"})],  # decode steps evict too
)
def test_uneven_policies_hold_half_the_cache_at_budget_half_with_the_padded_layouts_decisions(
    smol, long_text, monkeypatch, name, params
):
    """1024 prompt tokens, budget 512, 8 steps: the bytes are the kept entries x (K + V) x D x dtype size plus
    page rounding only (each head's last page, the zero page, spare pages: under 3 %), at most 0.52 of the
    prompt's full cache (the padded layout holds ~0.70); the same evictions and tokens as the padded
    layout."""
    ids = prefix_ids(smol, long_text, 1024)
    opts = RunOptions(budget=512, max_new_tokens=8, stop_at_eos=False, record="summary")
    made: list[KVCache] = []
    monkeypatch.setattr(loop_module, "KVCache", remembered(made))
    paged = run(smol, make_policy(name, params), ids, prefill=1024, steps=8, teacher=False, opts=opts)
    (cache,) = made
    monkeypatch.setattr(loop_module, "KVCache", Padded)
    padded = run(smol, make_policy(name, params), ids, prefill=1024, steps=8, teacher=False, opts=opts)
    m = paged.metrics
    stores = [layer._live for layer in cache.layers]
    assert all(isinstance(store, PagedStore) for store in stores)
    kept = int(sum(layer.valid.sum() for layer in cache.layers))
    pool = stores[0].pools["keys"]
    entry = 2 * pool.shape[-1] * pool.element_size()  # one slot's key and value
    pages = sum(store.pools["keys"].shape[0] for store in stores)
    assert m["kv_bytes_final"] == pages * PAGE * entry  # what is allocated: every page of every pool
    rows = sum(store.rows for store in stores)
    assert kept == 512 * rows and kept * entry < m["kv_bytes_final"] < (kept + 2 * PAGE * rows) * entry
    assert m["kv_bytes_peak"] / m["kv_bytes_prefill"] <= 0.52
    assert padded.metrics["kv_bytes_peak"] / m["kv_bytes_prefill"] > 0.6
    assert paged.meta.tokens == padded.meta.tokens
    assert_same_decisions(paged, padded)


def test_a_layer_mostly_freed_in_place_is_compacted_and_decides_the_same(smol, long_text, monkeypatch):
    """CORM frees in place (budget-free) and a token refills one freed slot per step: once a layer's slots in
    use exceed `HOLES` x its fullest head's kept ones + `GROWTH`, its kept slots are laid out again, so steps
    attend to them only. The decisions and losses are the uncompacted layout's."""
    ids = prefix_ids(smol, long_text, 212)
    compact, cache = corm_run(smol, ids, monkeypatch)
    monkeypatch.setattr(frees, "HOLES", float("inf"))
    holey, old = corm_run(smol, ids, monkeypatch)
    assert_same_decisions(compact, holey)  # a step logs its evictions in slot order, which compaction changes
    torch.testing.assert_close(compact.tensors["steps/nll"], holey.tensors["steps/nll"], rtol=1e-5, atol=1e-6)
    compacted = 0
    for new, was in zip(cache.layers, old.layers, strict=True):
        assert new.store.n <= HOLES * int(new.valid.sum(-1).max()) + GROWTH
        compacted += new.store.n < was.store.n
    assert_same_kept(cache, old)  # the same positions kept, in other slots
    assert compacted > len(cache.layers) // 2
    # a budget-free policy reading attention rows is never paged: a step would gather every page
    assert not any(isinstance(layer._live, PagedStore) for layer in cache.layers)


@pytest.mark.parametrize(
    "storage,in_place", [(Storage(), True), (Storage(4, group=16, residual=32), False)], ids=["plain", "kivi"]
)
def test_marked_slots_are_freed_where_they_lie_and_decide_as_listed_holes(
    smol, long_text, monkeypatch, storage, in_place
):
    """CORM marks the slots it frees (`free` given a mask): a layer of plain buffers then clears them where
    they lie and the next tokens refill each head's free slots (`LayerBook.in_place`), with no list of holes.
    The run decides, loses and grows exactly as freeing the same slots by index into listed holes does. Packed
    storage (KIVI), where a slot's place decides its quantization group, lists the free slots again once the
    prompt is packed, so its runs are unchanged too."""
    ids = prefix_ids(smol, long_text, 212)
    marked, cache = corm_run(smol, ids, monkeypatch, storage)
    monkeypatch.setattr(frees, "frees_in_place", lambda view: False)
    listed, old = corm_run(smol, ids, monkeypatch, storage)
    assert all(book.in_place is in_place for book in cache.books)
    assert not any(book.in_place for book in old.books)
    assert_same_decisions(marked, listed)
    torch.testing.assert_close(marked.tensors["steps/nll"], listed.tensors["steps/nll"], rtol=1e-5, atol=1e-6)
    for new, was in zip(cache.layers, old.layers, strict=True):
        assert new.store.n == was.store.n  # a freed slot is refilled, not left behind: the layers grow alike
    assert_same_kept(cache, old)
