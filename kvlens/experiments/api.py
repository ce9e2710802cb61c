"""High-level entry points shared by the CLI and the app: text in, `Run` out."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvlens.engine.context import Observer
from kvlens.engine.loop import RunOptions, StepEvent, run
from kvlens.engine.models import LoadedModel
from kvlens.engine.perturbation import measured
from kvlens.errors import KvlensError
from kvlens.policies import make_policy
from kvlens.runs.run import Run


def encode(model: LoadedModel, text: str, chat: bool = False) -> list[int]:
    """Token ids of `text` with the tokenizer's default special tokens (or wrapped in its chat template)."""
    if text is None or not text.strip():
        raise KvlensError("The prompt is empty: type or pick some text.")
    tok = model.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise KvlensError("This model's tokenizer has no chat template; turn chat mode off.")
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return list(tok(text).input_ids)


def generate(
    model: LoadedModel,
    prompt: str,
    policy: str,
    params: dict | None = None,
    *,
    opts: RunOptions,
    chat: bool = False,
    observers: Sequence[Observer] = (),
    on_step: Callable[[StepEvent], None] | None = None,
    cancel: threading.Event | None = None,
    meta: dict | None = None,
    measure: bool = False,
) -> Run:
    """Generate up to `opts.max_new_tokens` tokens after `prompt` under a policy (`measure`: perturbation
    too)."""
    pol = make_policy(policy, params)
    ids = encode(model, prompt, chat)

    def go(obs, cb):
        return run(
            model,
            pol,
            ids,
            prefill=len(ids),
            steps=opts.max_new_tokens,
            teacher=False,
            opts=opts,
            observers=obs,
            on_step=cb,
            cancel=cancel,
            meta=meta,
        )

    return _go(model, go, observers, on_step, measure)


def perplexity(
    model: LoadedModel,
    text: str,
    policy: str,
    params: dict | None = None,
    *,
    prefill: int,
    tokens: int,
    opts: RunOptions,
    observers: Sequence[Observer] = (),
    on_step: Callable[[StepEvent], None] | None = None,
    cancel: threading.Event | None = None,
    meta: dict | None = None,
    measure: bool = False,
) -> Run:
    """Teacher-forced perplexity: prefill `prefill` tokens, then score the next `tokens` one at a time.

    `measure` adds the output perturbation and the KL to the full cache (`kvlens.engine.perturbation`)."""
    pol = make_policy(policy, params)
    ids = encode(model, text)
    if prefill < 1 or tokens < 1:
        raise KvlensError("--prefill and --tokens must both be at least 1.")

    def go(obs, cb):
        return run(
            model,
            pol,
            ids,
            prefill=prefill,
            steps=tokens,
            teacher=True,
            opts=opts,
            observers=obs,
            on_step=cb,
            cancel=cancel,
            meta=meta,
        )

    return _go(model, go, observers, on_step, measure)


def _go(model: LoadedModel, go: Callable, observers, on_step, measure: bool) -> Run:
    """`go(observers, on_step)`, with the perturbation meter on (`measured`) if `measure`."""
    return measured(model, go, observers, on_step) if measure else go(observers, on_step)
