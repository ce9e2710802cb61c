"""`KVCache`: the cache handed to the model as `past_key_values`, one `SlotRows` view per layer.

Memory. The prompt's cache is the prefill's own tensors; the first compression below `limit` slots moves the
kept slots into buffers of exactly `limit` slots (budget + the one token of a step), so the prompt's memory is
really freed; later steps write into them in place. Caches that grow (full, budget-free policies) grow by
chunks up to `limit` (the run's length). In all-layer mode (a budgeted policy the engine batches:
`kvlens.engine.batching`) those buffers are one store of L * Hkv rows that the cache allocates itself
when the first layer compresses, and each layer becomes a view of its rows: a decode step's one eviction per
head then runs once for all layers. A layer of its own store whose heads keep different counts may be laid
out in pages instead (`kvlens.kvcache.paged`), each head holding its own slots, not its fullest head's count
(in the all-layer store they stay padded). After the prompt's compression the stores may become packed
(`kvlens.kvcache.quantized`). `nbytes` is what is allocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache.channels import ChannelStates
from kvlens.kvcache.contract import LOSSY
from kvlens.kvcache.paged import PagedStore
from kvlens.kvcache.quantize import Storage
from kvlens.kvcache.quantized import SHARED_STORE, PackedStore, pack, prune, seal_layers
from kvlens.kvcache.store import STATS, LayerBook, SlotStore, listed
from kvlens.kvcache.tokens import reserve_room
from kvlens.kvcache.views import SlotRows, own_layout


class KVCache:
    """The cache handed to the model as `past_key_values`: one `SlotRows` view per layer.

    Each forward runs inside `feeding(positions)` (the true positions `(q,)` of the tokens fed): `update`
    writes them and returns the layer's slots in use (views, no copy); inside `replaying()` as well it writes
    nothing and returns the slots in use followed by the pass's own keys and values. `limit`: the most slots a
    layer will need (budget + 1, or the run's length for growing caches; per layer after `set_budgets`).
    `all_layers=True` (a budgeted policy the engine batches, `kvlens.engine.batching.batchable`): a compressed
    layer's slots go into the rows of one store for every layer (see the module docstring). `chunked`: a
    chunked prefill, whose chunks fill freed slots first (`kvlens.kvcache.tokens.append`). `paged`: a layer
    with a store of its own whose heads keep different counts gets a `PagedStore` (no padding held; keys and
    values in the model's dtype only, so not with packed storage or pruned keys; never in all-layer mode).
    `compacts`: a layer whose slots in use are mostly freed ones is laid out again (a budget-free policy frees
    in place, `SlotRows.free`).
    """

    def __init__(
        self,
        n_layers: int,
        limit: int | None = None,
        all_layers: bool = False,
        chunked: bool = False,
        paged: bool = False,
        compacts: bool = False,
    ):
        self.all_layer_mode = all_layers
        self.chunked = chunked
        self.shared: SlotStore | None = None
        self.books = [
            LayerBook(i, limit, paged=paged and not all_layers, compacts=compacts) for i in range(n_layers)
        ]
        self.layers = [SlotRows([book], owner=self) for book in self.books]
        self._positions: torch.Tensor | None = None
        self._replaying = False  # a replay pass is being fed: `update` caches nothing
        self._everywhere: SlotRows | None = None
        self._in_place = False  # inside `feeding`: the forward's attention reads paged segments in place

    @property
    def positions(self) -> torch.Tensor:
        """`(q,)` the true positions of the tokens being fed (inside `feeding`)."""
        if self._positions is None:
            raise RuntimeError("kvlens: the engine feeds the cache inside `KVCache.feeding(positions)`")
        return self._positions

    @contextlib.contextmanager
    def feeding(self, positions: torch.Tensor, in_place: bool = False) -> Iterator[None]:
        """One forward of the tokens at `positions` `(q,)`; `in_place`: its attention reads a paged layer's
        segments where they lie at a decode step (`reads_pages`; the run reads no attention rows and no layer
        slides)."""
        before, self._positions, self._in_place = self._positions, positions, in_place
        try:
            yield
        finally:
            self._positions, self._in_place = before, False

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A replay pass (`Policy.replay_passes`): `update` attends to the cache and caches nothing."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def __call__(self, view: SlotRows, capacity: int, padded: bool) -> tuple[SlotStore, slice]:
        """Where a layer's compressed layout goes: its rows of the all-layer store, or a store of its own
        (paged when its book pages and its heads keep different counts, `padded`)."""
        if not self.all_layer_mode or len(view.books) != 1 or capacity != view.books[0].limit:
            return own_layout(view, capacity, padded)
        hkv = view.keys.shape[1]
        if self.shared is None:
            self.shared = view._live.empty_like(hkv * len(self.layers), capacity)
        i = view.books[0].layer
        return self.shared, slice(i * hkv, (i + 1) * hkv)

    def set_budgets(self, budgets: list[int], extra: int = 1) -> None:
        """Each layer's own budget (an allocating policy's): its limit becomes that budget + `extra` (the one
        token of a decode step, or a prefill chunk)."""
        for book, budget in zip(self.books, budgets, strict=True):
            book.limit = budget + extra

    def all_layers(self) -> SlotRows | None:
        """Every layer's rows as one view, once every layer lives in the all-layer store (else None)."""
        if self.shared is None or any(view.store is not self.shared for view in self.layers):
            return None
        if self._everywhere is None:
            self._everywhere = SlotRows(self.books, self.shared, slice(0, self.shared.rows), owner=self)
        return self._everywhere

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if self._replaying:  # a replay pass attends to the cache and to itself, and leaves nothing behind
            return torch.cat([layer.keys, key_states], 2), torch.cat([layer.values, value_states], 2)
        layer.append(key_states, value_states, self.positions, self.chunked)
        if key_states.shape[2] == 1 and self.reads_pages(layer) is not None:  # attention reads them in place
            return key_states[:, :, :0], value_states[:, :, :0]
        store = layer._live  # attention changes neither: no working copy is kept (`SlotStore.read`)
        if key_states.shape[2] == 1 and self.reads_channels(layer) is not None:  # keys read in place
            return key_states[:, :, :0], store.read("values", layer.rows)
        return store.read("keys", layer.rows), store.read("values", layer.rows)

    def reads_pages(self, layer: SlotRows) -> PagedStore | None:
        """The paged store whose segments (`PagedStore.reserve`) a decode step's attention on `layer` reads in
        place (`kvlens.engine.attention.decode_segments`), so `update` hands it no keys or values; None unless
        the forward's attention does (`feeding(..., in_place=True)`), the layer
        is laid out in segments and no policy holds a working copy."""
        store = layer._live
        if (
            self._in_place
            and isinstance(store, PagedStore)
            and store.segments is not None
            and not store.working
        ):
            return store
        return None

    def reads_channels(self, layer: SlotRows) -> ChannelStates | None:
        """The channel-pruned keys (ThinK) a decode step's attention on `layer` reads in place
        (`kvlens.engine.attention.decode_channels`), so `update` hands it no keys; None unless the forward's
        attention does (`feeding(..., in_place=True)`) and no policy holds a working copy."""
        store = layer._live
        if self._in_place and isinstance(store, PackedStore) and not store.working:
            keys = store.packed.get("keys")
            if isinstance(keys, ChannelStates):
                return keys
        return None

    def reserve(self, tokens: int) -> None:
        """Nothing leaves any more and at most `tokens` more tokens come (a policy that compressed the prompt
        only): each layer of its own store gets room for exactly them (`kvlens.kvcache.tokens.reserve`)."""
        for view in self.layers:
            if view.store is not None and view.store is not self.shared:
                reserve_room(view.books[0], view.store, view.rows, tokens)

    def stores(self) -> list[SlotStore]:
        """Every store in use, once each."""
        return list({id(v.store): v.store for v in self.layers if v.store is not None}.values())

    def quantize(self, storage: Storage) -> None:
        """Keys and values into `storage` (after the prompt's compression); nothing for the model's dtype."""
        if storage.rank_layers:
            for first in range(0, len(self.layers), storage.rank_layers):
                views = self.layers[first : first + storage.rank_layers]
                limit = max((v.books[0].limit or 0) for v in views)
                if not all(v.rows == slice(0, v._live.rows) for v in views):
                    raise KvlensError(SHARED_STORE)
                stores = [v._live for v in views]
                for old, new in zip(stores, seal_layers(storage, stores, limit), strict=True):
                    self._replace(old, new)
        elif storage.packed:
            for store in self.stores():
                limits = [b.limit for v, b in zip(self.layers, self.books, strict=True) if v.store is store]
                self._replace(store, pack(store, storage, max((lim or 0) for lim in limits)))

    def prune_keys(self, plans: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keys into channel-pruned storage (after the prompt's compression): `plans[i]` is layer i's kept
        channels `(Hkv, K)` and its slots that keep every channel `(Hkv, n)` bool
        (`kvlens.kvcache.quantized.prune`)."""
        for store in self.stores():
            parts = sorted(
                (
                    (view.rows.start, plan)
                    for view, plan in zip(self.layers, plans, strict=True)
                    if view.store is store
                ),
                key=lambda part: part[0],
            )
            channels = torch.cat([c for _, (c, _) in parts])
            self._replace(store, prune(store, channels, torch.cat([w for _, (_, w) in parts])))

    def _replace(self, old: SlotStore, new: SlotStore) -> None:
        """Every view of `old` now reads `new` (the same slots, in packed storage); its layers' run state says
        whether that storage is lossy (`LOSSY`). A layer that freed in place lists its free slots again,
        lowest first (packed storage frees by index: `kvlens.kvcache.frees.frees_in_place`)."""
        for view in filter(None, [*self.layers, self._everywhere]):
            if view.store is old:
                view.store = new
                for book in view.books:
                    book.state[LOSSY] = not new.lossless
                    if book.in_place:
                        book.in_place, book.holes = False, listed(~view.valid)
        if self.shared is old:
            self.shared = new

    def commit(self) -> None:
        """Packed storage: store what a policy changed in the working copies (`PackedStore.commit`)."""
        for store in self.stores():
            store.commit()

    def mark(self) -> list[tuple[Any, ...]]:
        """What `rewind` needs to bring a cache that since only grew (no compression) back to now: each
        layer's slots in use, their positions and validity (appends may fill freed slots), its bookkeeping and
        its packed storage (a flush quantizes tokens for good)."""
        self.commit()
        stores = [view._live for view in self.layers]
        return [
            (
                store.n,
                store.order,
                view.pos.clone(),
                view.valid.clone(),
                dataclasses.replace(book),
                store.snapshot(),
            )
            for view, store, book in zip(self.layers, stores, self.books, strict=True)
        ]

    def rewind(self, mark: list[tuple[Any, ...]]) -> None:
        """Forget every token appended since `mark` (e.g. one question and its answer, before the next
        question on the same compressed context)."""
        with torch.inference_mode():  # the buffers are inference tensors when the run made them
            for view, book, (n, order, pos, valid, saved, packed) in zip(
                self.layers, self.books, mark, strict=True
            ):
                store = view._live
                store.restore(packed)
                store.n = n
                view.pos, view.valid = pos, valid
                for (
                    name,
                    fill,
                ) in STATS.items():  # the slots past `n` are free again (appends since wrote them)
                    store.buffers[name][view.rows, n:] = fill
                store.order = order
                vars(book).update(vars(saved))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].n_slots

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (each store once)."""
        return sum(s.nbytes(slice(0, s.rows)) for s in self.stores())

    def kept_counts(self) -> torch.Tensor:
        """Valid slots per layer and KV head, `(L, Hkv)` (without padding every head keeps `n_kept`)."""
        if not any(book.pad for book in self.books):
            return torch.tensor(
                [[book.n_kept] * layer.kv_heads for book, layer in zip(self.books, self.layers, strict=True)]
            )
        return torch.stack([layer.kept_per_row() for layer in self.layers]).cpu()
