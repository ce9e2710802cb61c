"""`kvlens.pipeline`: kvpress's question-answering pipeline over a context compressed once.

`pipeline(model, tokenizer)(context, question=q, policy="kvzip", ratio=0.75)` follows `kvlens bench tasks`'s
protocol (`kvlens.experiments.bench.tasks`): the chat template's user turn is the context then the question;
the context's tokens are compressed once to kvpress's kept count, then each question is appended uncompressed
and answered greedily from that same cache. `query_aware=True` compresses context and question together
(SnapKV's setting), one compression per question. An answer is therefore the task suite's answer for that
sample.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlens.engine.models import LoadedModel
from kvlens.engine.shared_prefill import QUIET, answer, prepare, split_prompt
from kvlens.hf.attach import adopt, attach, require_tokenizer
from kvlens.hf.cache import Settings
from kvlens.policies import resolve_budget


class Pipeline:
    """Answers questions about a context under a policy (see the module docstring)."""

    def __init__(self, model: LoadedModel):
        self.model = model

    def __call__(
        self,
        context: str,
        question: str = "",
        *,
        questions: list[str] | None = None,
        policy: str = "full",
        ratio: float | None = None,
        budget: int | float | None = None,
        max_new_tokens: int = 50,
        query_aware: bool = False,
        chat: bool = True,
        kv_bits: int | None = None,
        **params,
    ) -> dict:
        """`{"answer": str}` for one question, `{"answers": [str, ...]}` for `questions`."""
        settings = Settings.of(policy, ratio, budget, "summary", kv_bits, params)
        asked = [question] if questions is None else list(questions)
        parts = [split_prompt(self.model, context, q, chat) for q in asked]
        with attach(self.model.model):
            if query_aware:
                answers = [self._answer(settings, c + q, [[]], max_new_tokens)[0] for c, q in parts]
            else:
                answers = self._answer(settings, parts[0][0], [q for _, q in parts], max_new_tokens)
        return {"answer": answers[0]} if questions is None else {"answers": answers}

    def _answer(
        self, settings: Settings, prompt: list[int], questions: list[list[int]], max_new_tokens: int
    ) -> list[str]:
        """`prompt` compressed once, then each question appended to it in turn and answered."""
        extra = max(len(q) for q in questions) + max_new_tokens
        opts = dataclasses.replace(QUIET, storage=settings.opts.storage)
        budget = resolve_budget(
            settings.policy, settings.options(len(prompt)).budget, len(prompt), len(prompt) + extra
        )
        loop, logits = prepare(self.model, settings.policy, prompt, budget, extra, opts=opts)
        out = []
        for question in questions:
            mark = loop.cache.mark()
            with torch.inference_mode():
                tokens, _ = answer(loop, question, len(prompt), max_new_tokens, None if question else logits)
            loop.cache.rewind(mark)
            out.append(self.model.tokenizer.decode(tokens, skip_special_tokens=True))
        return out


def pipeline(model: torch.nn.Module, tokenizer=None) -> Pipeline:
    """A question-answering pipeline on the caller's model (probed and refused as `kvlens check-model`
    would)."""
    loaded = adopt(model, tokenizer)
    require_tokenizer(loaded, "kvlens.pipeline")
    return Pipeline(loaded)
