"""kvlens inside the caller's own transformers code: `cache`, `press`, `pipeline` and `attach`.

`cache(model, policy, ratio=...)` is a `transformers.Cache` for `model.generate`; `press(model, policy, ...)`
runs a policy in every generation of a block, kvpress style; `pipeline(model, tokenizer)` answers a question
about a context compressed once, as the task suite does; `attach(model)` switches the model to kvlens's
attention for a block.
"""

from kvlens.hf.attach import attach
from kvlens.hf.cache import KvlensCache, cache
from kvlens.hf.pipeline import pipeline
from kvlens.hf.press import press

__all__ = ["KvlensCache", "attach", "cache", "pipeline", "press"]
