"""Compress once, then answer: the task protocol, with one prefill of a context shared by every policy and
budget.

The field's task benchmarks (kvpress's `evaluation/`, RULER, LongBench) compress a context once, right after
its prefill, then append the question uncompressed and generate the answer. `split_prompt` cuts a chat prompt
into that context and question, `slots_for` is the kept count at a compression ratio (kvpress's rounding, or
kvlens's earlier one). `prepare` sets a policy up that way (prefill, its replay passes, its step-0
compression, then `freeze`), and `answer` feeds a question as one chunk and generates greedily;
`KVCache.mark`/`rewind` ask several questions of one compressed context.

The prefill is most of the cost, and it is the same for every policy: `SharedPrefill` runs it once per prefill
kernel the policies use (SDPA for those that read no column sums, the eager statistics pass for those that do;
each gives its policies exactly the keys and values of their own runs) and keeps every layer's queries, keys,
values, column sums and last attention rows. `prepare(..., shared=...)` then rebuilds what a policy's own
prefill would have left (cache, `abar`, `nobs`, the last rows it reads, its `observe_prefill`) without running
the model: decisions are those of its own run, bit for bit (tested). A policy's replay passes (KVzip's
reconstruction) read the prompt's cache alone, not the budget: they run for the first of equal policies and
what they leave in each layer's run state is copied into the others (`SharedPrefill.replay`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlens.engine.architectures import rotary_of
from kvlens.engine.attention import last_rows
from kvlens.engine.context import RunContext
from kvlens.engine.hidden import HIDDEN, tap
from kvlens.engine.loop import RunOptions, _check_length, _Loop, feed
from kvlens.engine.models import LoadedModel
from kvlens.errors import KvlensError
from kvlens.kvcache import AttentionSpec
from kvlens.kvcache.cache import KVCache
from kvlens.policies import Policy, make_policy

QUIET = RunOptions(record="summary", log_decisions=False)
SLOT = "\x00question\x00"  # where the user's text goes in the chat template


def split_prompt(
    model: LoadedModel, context: str, question: str, chat: bool = True, answer_prefix: str = ""
) -> tuple[list[int], list[int]]:
    """Token ids of the context part (template start + context) and of the question part (question + template
    end, up to the assistant's turn, then `answer_prefix`, as kvpress's pipeline appends it), tokenized apart
    so the compressed span is exactly the context's."""
    tok = model.tokenizer
    head, tail = template_parts(model, chat)
    ids = tok(head + context, add_special_tokens=not chat).input_ids
    return list(ids), list(tok("\n\n" + question + tail + answer_prefix, add_special_tokens=False).input_ids)


def template_parts(model: LoadedModel, chat: bool) -> tuple[str, str]:
    """The chat template's text before and after the user's (empty without `chat`)."""
    if not chat:
        return "", ""
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise KvlensError("This model's tokenizer has no chat template; use --no-chat.")
    text = tok.apply_chat_template(
        [{"role": "user", "content": SLOT}], add_generation_prompt=True, tokenize=False
    )
    head, tail = text.split(SLOT)
    return head, tail


ROUNDINGS = ("kvpress", "kvlens")


def slots_for(ratio: float, tokens: int, rounding: str = "kvpress") -> int:
    """The slots kept of `tokens` at compression ratio `ratio` (the share removed). `kvpress`: `int(tokens *
    (1 - ratio))`, kvpress's `ScorerPress.compress` (`n_kept`); `kvlens`: `tokens - int(tokens * ratio)`, the
    rounding of the results made before the option (one slot more when `tokens * ratio` is not a whole
    number)."""
    if rounding == "kvpress":
        return int(tokens * (1 - ratio))
    if rounding == "kvlens":
        return tokens - int(tokens * ratio)
    raise KvlensError(f"Unknown rounding '{rounding}'; the roundings are {', '.join(ROUNDINGS)}.")


@dataclass
class _Layer:
    """One layer's prompt as the attention function saw it: query `(1, Hq, T, D)`, key/value `(1, Hkv, T, D)`,
    column sums `(Hkv, T)` (None: SDPA ran) and the last `rows` attention rows `(Hq, rows, T)`."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    spec: AttentionSpec
    abar: torch.Tensor | None
    last: torch.Tensor
    by_rows: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # SDPA layers: last rows recomputed, by count
    hidden: torch.Tensor | None = (
        None  # (T, d_model) the state entering the attention, when a policy reads it
    )

    def last_for(self, rows: int) -> torch.Tensor:
        """The last `rows` attention rows exactly as a policy's own prefill computes them."""
        if self.abar is not None:  # the eager pass: the same rows whatever the count kept
            return self.last[:, self.last.shape[1] - rows :]
        if rows not in self.by_rows:
            self.by_rows[rows] = last_rows(self.query, self.key, self.spec, rows)
        return self.by_rows[rows]


class _Capture(RunContext):
    """A run context that computes the prompt's statistics for a group of policies and keeps them per
    layer."""

    def __init__(self, cache: KVCache, column_sums: bool, rows: int, windowed: bool, rotary, hidden: bool):
        super().__init__(cache, make_policy("full"), windowed=windowed, rotary=rotary)
        self.column_sums, self.prefill_rows = column_sums, rows
        self.layers: list[_Layer] = []
        self.wants_hidden = hidden  # some policy reads the attention's input
        self.hidden: dict[int, torch.Tensor] = {}  # by layer

    def hidden_in(self, layer_idx: int, hidden: torch.Tensor) -> None:
        self.hidden[layer_idx] = hidden[0]

    def observe_prompt(self, layer, query, key, value, spec, abar, last) -> None:
        self.layers.append(_Layer(query, key, value, spec, abar, last, hidden=self.hidden.get(layer.layer)))


class SharedPrefill:
    """One context's prefill, kept for every policy in `policies` (at most two forwards: SDPA and eager)."""

    def __init__(self, model: LoadedModel, ids: list[int], policies: list[Policy | RunContext]):
        """`policies`: each a policy (what its own run computes in its prefill) or a run's context (what it
        computes with its observers)."""
        model.supported().require()
        _check_length(model, len(ids))
        self.model, self.ids, self.groups, self.logits = model, list(ids), {}, {}
        self.replays: dict[
            Policy, tuple[int, list[dict]]
        ] = {}  # per policy: its passes, what they left per layer
        t = time.perf_counter()
        needs = [_ctx_of(model, p) for p in policies]
        for sums in sorted({ctx.column_sums for ctx in needs}):
            rows = max(ctx.prefill_rows for ctx in needs if ctx.column_sums == sums)
            cache = KVCache(model.shape()["layers"], limit=len(ids))
            ctx = _Capture(
                cache,
                sums,
                min(rows, len(ids)),
                bool(model.supported().sliding),
                rotary_of(model.model, model.supported()),
                hidden=any(c.policy.needs().hidden_states for c in needs),
            )
            if ctx.wants_hidden:
                tap(model.model)
            with torch.inference_mode():
                self.logits[sums] = feed(model, cache, ctx, self.ids, 0)
            self.groups[sums] = ctx.layers
        self.ms = (time.perf_counter() - t) * 1000

    def restore(self, loop: _Loop) -> torch.Tensor:
        """Put into `loop`'s fresh cache what its own prefill would have left; the prompt's last logits."""
        ctx, cache = loop.ctx, loop.cache
        keep = min(ctx.prefill_rows, len(self.ids))
        positions = torch.arange(len(self.ids), device=loop.model.device)
        with cache.feeding(positions):
            for view, kept in zip(cache.layers, self.groups[ctx.column_sums], strict=True):
                view.append(kept.key.clone(), kept.value.clone(), positions)
                if ctx.wants_hidden and kept.hidden is not None:
                    view.state[HIDDEN] = kept.hidden
                ctx.observe_prompt(
                    view, kept.query, view.keys, view.values, kept.spec, kept.abar, kept.last_for(keep)
                )
        return self.logits[ctx.column_sums]

    def prompt_cache(self, policy: Policy) -> tuple[list[tuple], torch.Tensor]:
        """The prompt's uncompressed cache as `policy`'s own prefill computed it, per layer `(keys, values,
        valid, pos)` of shapes `(Hkv, T, D)` twice and `(Hkv, T)` twice (what `batch_answer.Kept` holds), and
        the prompt's last logits: the reference a compressed cache of `policy` differs from by its decisions
        alone (the SDPA and the eager prefill differ by float rounding)."""
        sums = _ctx_of(self.model, policy).column_sums
        layers = []
        for kept in self.groups[sums]:
            hkv, t = kept.key.shape[1], kept.key.shape[2]
            pos = torch.arange(t, device=kept.key.device).expand(hkv, t)
            layers.append(
                (kept.key[0], kept.value[0], torch.ones(hkv, t, dtype=torch.bool, device=pos.device), pos)
            )
        return layers, self.logits[sums]

    def replay(self, loop: _Loop) -> None:
        """`loop`'s replay passes, or what an equal policy's left in each layer's run state (copied, also for
        the first: the stored state is never the one a compression then changes)."""
        books = loop.cache.books
        if loop.policy not in self.replays:
            before = [dict(book.state) for book in books]
            loop.replay(self.ids)
            left = [
                {k: v for k, v in book.state.items() if before_k.get(k) is not v}
                for book, before_k in zip(books, before, strict=True)
            ]
            self.replays[loop.policy] = (loop.replay_passes, left)
        loop.replay_passes, left = self.replays[loop.policy]
        for book, state in zip(books, left, strict=True):
            book.state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def _ctx_of(model: LoadedModel, policy: Policy | RunContext) -> RunContext:
    """What a policy's own run would compute in its prefill (its context, without a cache), or a run's
    context as it is."""
    if isinstance(policy, RunContext):
        return policy
    return RunContext(None, policy, windowed=bool(model.supported().sliding))


def prepare(
    model: LoadedModel,
    policy: Policy,
    context: list[int],
    budget: int | None,
    extra: int,
    shared: SharedPrefill | None = None,
    opts: RunOptions = QUIET,
) -> tuple[_Loop, torch.Tensor]:
    """`policy` compressed once to `budget` slots after the prompt `context` (its own prefill, or restored
    from `shared`), then frozen; `extra`: the tokens that will be appended (questions and answers). Returns
    the loop and the prompt's last logits."""
    _check_length(model, len(context) + extra)
    model.supported()
    loop = _Loop(model, policy, opts, [], budget, len(context) + extra, once=True)
    with torch.inference_mode():
        if shared is None:
            logits = loop.forward(context, 0)
        else:
            if shared.ids != list(context):
                raise ValueError("The shared prefill is of another context.")
            logits = shared.restore(loop)
        if shared is None:
            loop.replay(context)
        else:
            shared.replay(loop)
        loop.compress_prompt()
    loop.freeze()
    return loop, logits


def answer(
    loop: _Loop,
    question: list[int],
    start: int,
    max_new_tokens: int,
    logits: torch.Tensor | None = None,
    done: Callable[[list[int]], bool] | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy answer after feeding `question` at positions start.. in one chunk (none: answer from `logits`,
    the prompt's); stops at the tokenizer's end-of-sequence or once `done(tokens)`. Returns the tokens and
    each one's NLL. (`kvlens.engine.batch_answer.answer_many` answers many loops at once.)"""
    eos = loop.model.tokenizer.eos_token_id
    tokens, nlls = [], []
    with torch.inference_mode():
        if question:
            logits = loop.forward(question, start)
        pos = start + len(question)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            token = int(torch.argmax(logits))
            tokens.append(token)
            nlls.append(float(-logp[token]))
            if token == eos or len(tokens) == max_new_tokens or (done is not None and done(tokens)):
                break
            logits = loop.forward([token], pos)
            pos += 1
    return tokens, nlls
