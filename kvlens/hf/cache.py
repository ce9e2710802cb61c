"""`kvlens.cache`: any kvlens policy as a `transformers.Cache` for `model.generate` on the caller's own model.

The cache drives the engine's own run state (`kvlens.engine.loop._Loop`): the same prefill statistics, step-0
compression, decode-time eviction and merging, quantized storage and decision log as `kvlens generate`, so the
same prompt and settings give the same tokens and decisions. `transformers` owns the loop: two forward hooks
on the model, installed once (`install`), act only on a forward whose `past_key_values` is a `KvlensCache`:
before it, the cache switches the model's attention implementation to kvlens's and hands it the run's context
through the forward's keyword arguments; after it (also when the forward raised), the cache compresses as the
engine does and switches the implementation back. Any other forward passes through them untouched. Positions
are true positions: `get_seq_length` counts every token fed, not the slots kept, so RoPE never re-indexes.

One cache follows one sequence from its prompt: a batch of several sequences (beam search, several prompts),
several new tokens at once after the prompt (assisted decoding) and a second, unrelated `generate` call are
refused with one sentence each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref

import pandas as pd
import torch
from transformers import Cache

from kvlens.engine.attention import ATTENTION_NAME, CONTEXT_KWARG
from kvlens.engine.loop import RunOptions, _Loop, _make_run, new_loop
from kvlens.engine.models import LoadedModel
from kvlens.engine.shared_prefill import slots_for
from kvlens.errors import KvlensError
from kvlens.hf.attach import adopt, require_tokenizer, switch
from kvlens.kvcache.quantize import Storage
from kvlens.levels import RecordLevel
from kvlens.policies import Policy, make_policy
from kvlens.runs.run import Run

ONE_SEQUENCE = (
    "A kvlens cache holds one sequence, but this forward has a batch of {n} (beam search, "
    "num_return_sequences or several prompts); generate one sequence per kvlens.cache."
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a kvlens cache runs: the policy, how much it keeps (`ratio`: kvpress's share removed, else
    `opts.budget`), and the run options (record level, storage)."""

    policy: Policy
    opts: RunOptions
    ratio: float | None = None

    @classmethod
    def of(
        cls,
        policy: str,
        ratio: float | None,
        budget: int | float | None,
        record: str,
        kv_bits: int | None,
        params: dict,
    ) -> Settings:
        """Validated settings, each mistake refused with one sentence before the model is touched."""
        pol = make_policy(policy, params)
        if ratio is not None and budget is not None:
            raise KvlensError(
                "Give ratio= (the share removed, as in kvpress) or budget= (slots, or the share kept), "
                "not both."
            )
        if ratio is not None and not (isinstance(ratio, (int, float)) and 0 <= ratio < 1):
            raise KvlensError(f"ratio must be in [0, 1), the share of the prompt removed (got {ratio!r}).")
        if pol.budget_free and (ratio is not None or budget is not None):
            raise KvlensError(f"Policy {policy} decides its own size; drop ratio= and budget=.")
        if not pol.budget_free and ratio is None and budget is None:
            raise KvlensError(
                f"Policy {policy} needs ratio= (the share of the prompt removed) or budget= (slots, or "
                f"the share kept)."
            )
        RecordLevel.parse(record)
        opts = RunOptions(budget=budget, record=record, storage=Storage(bits=kv_bits))
        return cls(pol, opts, None if ratio is None else float(ratio))

    def options(self, prompt_tokens: int) -> RunOptions:
        """The run options for a prompt of `prompt_tokens` (a ratio becomes kvpress's kept count)."""
        if self.ratio is None:
            return self.opts
        return dataclasses.replace(self.opts, budget=slots_for(self.ratio, prompt_tokens))


class KvlensCache(Cache):
    """A policy's compressed KV cache for one `model.generate` call (see the module docstring).

    After generation: `decisions` is the decision log, `run(sequences)` the kvlens `Run` and `save_run(path,
    sequences)` writes it as a run directory the app, `kvlens show` and `kvlens report` open.
    """

    def __init__(self, model: LoadedModel, settings: Settings):
        super().__init__(layers=[])
        self.model, self.settings = model, settings
        self.loop: _Loop | None = None
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # the tokens fed after the prompt, each chosen from the previous logits
        self.nlls: list[float] = []
        self.ms: list[float] = []  # each decode forward's time, compression included
        self.prefill_ms = 0.0
        self.logits: torch.Tensor | None = None  # (V,) the latest forward's last logits
        self._started = self._ended = self._t = (
            0.0  # the generation's first and last forward, this forward's start
        )
        self._restore: list[
            str | None
        ] = []  # the attention implementation a forward replaced (none: not switched)
        self._entered = contextlib.ExitStack()  # inference mode and the fed positions: `before` to `after`

    # -- transformers' Cache interface ------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.loop is None:
            raise KvlensError(
                "This kvlens cache was used without its model's hooks; pass it to the model it was "
                "made for (kvlens.cache(model, ...))."
            )
        return self.loop.cache.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens fed so far (the next token's position), not slots kept."""
        return len(self.prompt) + len(self.tokens)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def __len__(self) -> int:
        return self.model.shape()["layers"]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)

    def reorder_cache(self, beam_idx) -> None:
        raise KvlensError(
            "kvlens caches do not support beam search (num_beams > 1): each holds one sequence."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KvlensError(ONE_SEQUENCE.format(n=repeats))

    def batch_select_indices(self, indices) -> None:
        raise KvlensError(ONE_SEQUENCE.format(n=len(indices)))

    def crop(self, tokens_to_remove: int) -> None:
        raise KvlensError(
            "kvlens caches cannot be cropped (assisted or speculative decoding): a compressed cache "
            "cannot take back the tokens it already compressed."
        )

    def reset(self) -> None:
        raise KvlensError(
            "A kvlens cache follows one generation; make a new kvlens.cache instead of resetting it."
        )

    # -- the run, driven by the model's forward hooks ---------------------------------------------------
    def before(self, module, args, kwargs) -> dict:
        """Before a forward: switch the attention to kvlens's (`after` switches it back, also when this
        raises), check the input, feed its positions, hand the run's context to the attention."""
        self._restore = [
            switch(module, ATTENTION_NAME)
        ]  # before the run starts: it may probe the model (Q-Filters)
        self._entered.enter_context(torch.inference_mode())  # as the engine runs its forwards
        ids = kwargs.get("input_ids", next(iter(args), None))
        if ids is None:
            raise KvlensError("A kvlens cache needs input_ids (token ids), not inputs_embeds.")
        if ids.shape[0] != 1:
            raise KvlensError(ONE_SEQUENCE.format(n=ids.shape[0]))
        ids = ids[0].tolist()
        seen = self.get_seq_length()
        positions = kwargs.get("position_ids")
        first = seen if positions is None else int(positions.reshape(-1)[0])
        if self.loop is None:
            self._start(ids, first)
        elif first != seen:
            raise KvlensError(
                f"This kvlens cache already holds a generation of {seen} tokens; make a new "
                f"kvlens.cache for each generate call."
            )
        elif len(ids) != 1:
            raise KvlensError(
                "kvlens compresses after every token, so it cannot take several new tokens at once "
                "(assisted or speculative decoding, or a chunked prefill): generate without them."
            )
        else:
            self._choose(ids[0])
        self._entered.enter_context(
            self.loop.cache.feeding(
                torch.arange(seen, seen + len(ids), device=self.model.device), self.loop.ctx.in_place
            )
        )
        self._t = time.perf_counter()
        return {**kwargs, CONTEXT_KWARG: self.loop.ctx}

    def after(self, module, output) -> None:
        """After a forward (also one that raised): compress as the engine does after it, restore the
        attention."""
        try:
            if output is None:
                return
            with torch.no_grad():
                self.loop.ctx.accumulate()
                if self.tokens:
                    self.loop.compress_step(len(self.tokens))
                else:
                    self.loop.after_prompt(self.prompt)
            self.logits = output.logits[0, -1].detach()
            self._ended = time.perf_counter()
            elapsed = (self._ended - self._t) * 1000
            if self.tokens:
                self.ms.append(elapsed)
            else:
                self.prefill_ms = elapsed
        finally:
            for name in self._restore:
                switch(module, name)
            self._restore = []
            self._entered.close()

    def _start(self, prompt: list[int], first: int) -> None:
        if first != 0:
            raise KvlensError(
                f"A kvlens cache starts from the prompt at position 0, but this forward starts at "
                f"position {first}."
            )
        opts = self.settings.options(len(prompt))
        self.loop = new_loop(self.model, self.settings.policy, opts, [], len(prompt), None)
        self.prompt = prompt
        self._started = time.perf_counter()

    def _choose(self, token: int) -> None:
        """The token `generate` chose from the previous forward's logits, with its NLL."""
        self.tokens.append(token)
        self.nlls.append(self._nll(token))

    def _nll(self, token: int) -> float:
        """-log p(token) under the latest forward's logits."""
        return float(-torch.log_softmax(self.logits.float(), dim=-1)[token])

    def _ran(self) -> _Loop:
        if self.loop is None:
            raise KvlensError("This kvlens cache has not run yet: pass it to model.generate first.")
        return self.loop

    # -- what the run left ------------------------------------------------------------------------------
    @property
    def decisions(self) -> pd.DataFrame:
        """The decision log: one row per eviction or merge (`kvlens.runs.decisions`)."""
        return self._ran().log.frame()

    def run(self, sequences: torch.Tensor | None = None) -> Run:
        """The generation as a kvlens `Run`. `sequences`: `generate`'s output `(1, T)`, whose last token the
        model never fed back (without it the run ends at the last token fed)."""
        loop = self._ran()
        require_tokenizer(self.model, "A run's files (cache.run, cache.save_run)")
        tokens, nlls = list(self.tokens), list(self.nlls)
        if sequences is not None:
            fed = [*self.prompt, *tokens]
            seq = torch.as_tensor(sequences).reshape(-1).tolist()
            if seq[: len(fed)] != fed or len(seq) != len(fed) + 1:
                raise KvlensError(
                    "These sequences are not the output of the generate call that used this cache."
                )
            tokens.append(seq[-1])
            nlls.append(self._nll(seq[-1]))
        if not tokens:
            raise KvlensError(
                "The generation fed back no token; pass generate's output: cache.run(sequences)."
            )
        meta = {"command": f"model.generate with kvlens.cache({self.settings.policy.name!r})"}
        total_s = self._ended - self._started  # the first forward's start to the last one's end
        return _make_run(
            loop, self.model, self.prompt, tokens, nlls, self.ms, self.prefill_ms, total_s, False, meta
        )

    def save_run(self, path, sequences: torch.Tensor | None = None):
        """Write `run(sequences)` as a run directory; returns its path."""
        return self.run(sequences).save(path)


def _before(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    return (args, cache.before(module, args, kwargs)) if isinstance(cache, KvlensCache) else None


def _after(module, args, kwargs, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, KvlensCache):
        cache.after(module, output)


# each model's two hook handles (weakly: a model that goes away takes its entry along)
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def install(model: torch.nn.Module) -> None:
    """The cache hooks on `model`, once (inert for every forward that carries no kvlens cache)."""
    if model not in _HOOKS:
        _HOOKS[model] = (
            model.register_forward_pre_hook(_before, with_kwargs=True),
            model.register_forward_hook(_after, with_kwargs=True, always_call=True),
        )


def cache(
    model: torch.nn.Module,
    policy: str,
    *,
    ratio: float | None = None,
    budget: int | float | None = None,
    record: str = "summary",
    kv_bits: int | None = None,
    tokenizer=None,
    **params,
) -> KvlensCache:
    """A `transformers.Cache` that runs `policy` inside `model.generate(ids, past_key_values=cache)`.

    `ratio`: the share of the prompt removed (kvpress's), or `budget`: slots per KV head, or a float in (0, 1]
    the share kept; `record`: summary, states or attention; `kv_bits`: quantized storage; `params`: the
    policy's parameters; `tokenizer`: needed only by KVzip, Q-Filters and `save_run` (default: the one saved
    beside the model, local files only). The model is probed first and refused as `kvlens check-model`
    would; two forward hooks then stay on it, inert unless a kvlens cache is passed.
    """
    settings = Settings.of(policy, ratio, budget, record, kv_bits, params)
    loaded = adopted(model, tokenizer, settings)
    install(model)
    return KvlensCache(loaded, settings)


def adopted(model: torch.nn.Module, tokenizer, settings: Settings) -> LoadedModel:
    """`adopt(model, tokenizer)`, refused at once when the policy needs a tokenizer and there is none."""
    loaded = adopt(model, tokenizer)
    if settings.policy.needs().tokenizer:
        require_tokenizer(loaded, f"Policy {settings.policy.name}")
    return loaded
