"""`KvlensLM`: lm-evaluation-harness's HF model (`lm_eval.models.huggingface.HFLM`, lm-eval 0.4.x) with every
request run under a kvlens cache.

Each request gets a fresh `KvlensCache` (`kvlens.cache`'s, on the model adopted once):

- `generate_until`: `model.generate` with the cache, as HFLM generates. lm-eval's prompt holds the question,
  so the prompt, question included, is compressed once after its prefill (the query-aware protocol, SnapKV's
  setting); it then decodes with the method's own protocol, as `kvlens.cache` does (SnapKV's family and
  KVzip let the cache grow, as kvpress does; decode-time methods keep their budget at each step).
- `loglikelihood` (and `loglikelihood_rolling`): the context but its last token is the prompt, compressed
  after its prefill; its last token and the continuation are then fed one at a time, teacher-forced, so that
  every scored token is predicted from the compressed cache (a context of one token is not compressed).

Batch size 1 only: a kvlens cache holds one sequence. `requests` keeps one `Request` per request (its
decision log, fed tokens, budget, bytes and time) for `kvlens eval`'s summary.
"""

from __future__ import annotations

import dataclasses
import time

import pandas as pd
import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from kvlens.errors import KvlensError
from kvlens.eval.offline import quiet_datasets
from kvlens.hf.cache import KvlensCache, Settings, adopted, install

quiet_datasets()  # lm-eval loads its tasks' data through `datasets`: local files contact no host


@dataclasses.dataclass
class Request:
    """One request's cache after it ran: `kind` (generate_until or loglikelihood), the tokens it was fed,
    its budget (slots per KV head; None: budget-free), its decision log, its bytes, slots and time."""

    kind: str
    prompt_tokens: int
    fed: int
    budget: int | None
    decisions: pd.DataFrame
    kv_bytes: int  # the cache's physical bytes at the end
    kept_slots: float  # the slots it kept at the end, mean over layers and KV heads
    seconds: float


@register_model("kvlens")
class KvlensLM(HFLM):
    """HFLM whose every request runs under `kvlens.cache(model, policy, ratio=..., **params)` (see the module
    docstring). `pretrained`, `tokenizer` and the other keywords are HFLM's; `params` the policy's."""

    def __init__(
        self,
        pretrained,
        policy: str = "full",
        ratio: float | None = None,
        params: dict | None = None,
        batch_size: int | str = 1,
        **kwargs,
    ) -> None:
        if str(batch_size) != "1":
            raise KvlensError(
                f"kvlens evaluates one request at a time (a kvlens cache holds one sequence): use batch "
                f"size 1, not {batch_size}."
            )
        self.settings = Settings.of(
            policy, None if ratio is None else float(ratio), None, "summary", None, params or {}
        )
        super().__init__(pretrained=pretrained, batch_size=1, **kwargs)
        self.loaded = adopted(self.model, self.tokenizer, self.settings)
        install(self.model)
        self.requests: list[Request] = []

    def _cache(self) -> KvlensCache:
        return KvlensCache(self.loaded, self.settings)

    def _keep(self, kind: str, cache: KvlensCache, started: float) -> None:
        loop = cache.loop
        fed = len(cache.prompt) + len(cache.tokens)
        self.requests.append(
            Request(
                kind=kind,
                prompt_tokens=len(cache.prompt),
                fed=fed,
                budget=loop.budget,
                decisions=cache.decisions,
                kv_bytes=int(loop.cache.nbytes),
                kept_slots=float(loop.cache.kept_counts().float().mean()),
                seconds=time.perf_counter() - started,
            )
        )

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """HFLM's generation with a fresh kvlens cache (`context` `(1, T)`)."""
        started, cache = time.perf_counter(), self._cache()
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        self._keep("generate_until", cache, started)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """`(sum of log p(continuation), whether it is greedy)` per `((context, continuation), context ids,
        continuation ids)`, in order, each under a fresh cache (contexts left-truncated as HFLM does)."""
        out = []
        for request, context, continuation in tqdm(requests, disable=disable_tqdm or self.rank != 0):
            ids = (context + continuation)[-(self.max_length + 1) :][:-1]
            prompt = max(1, len(ids) - len(continuation))  # the context's tokens but its last one
            logits = self._teacher_forced(ids, prompt)[-len(continuation) :]  # (C, V)
            logp = F.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(continuation, device=logp.device)
            answer = (
                float(logp.gather(1, target[:, None]).sum()),
                bool((logp.argmax(-1) == target).all()),
            )
            out.append(answer)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return out

    def _teacher_forced(self, ids: list[int], prompt: int) -> torch.Tensor:
        """`(len(ids), V)` logits: `ids[:prompt]` prefilled and compressed, then each later one fed alone."""
        started, cache = time.perf_counter(), self._cache()
        rows = [self._forward(cache, ids, 0, prompt)]
        rows += [self._forward(cache, ids, i, i + 1) for i in range(prompt, len(ids))]
        self._keep("loglikelihood", cache, started)
        return torch.cat(rows)

    def _forward(self, cache: KvlensCache, ids: list[int], start: int, end: int) -> torch.Tensor:
        """`(end - start, V)` logits of `ids[start:end]` fed at their positions (given: the cache's hook has
        counted them before the forward asks it for its length)."""
        at = torch.arange(start, end, device=self.device)
        feed = torch.tensor([ids[start:end]], device=self.device)
        with torch.no_grad():
            out = self.model(
                feed, past_key_values=cache, use_cache=True, position_ids=at[None], cache_position=at
            )
        return out.logits[0]

    def get_model_info(self) -> dict:
        """The model's size and dtype and kvlens's settings (HFLM's asks the hub for a revision; this never
        does)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "kvlens_policy": self.settings.policy.name,
            "kvlens_params": self.settings.policy.params(),
            "kvlens_ratio": self.settings.ratio,
        }
