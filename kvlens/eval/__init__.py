"""kvlens in lm-evaluation-harness (lm-eval 0.4.x, the optional extra `kvlens[eval]`).

`KvlensLM` (`kvlens.eval.lm`) is lm-eval's HF model with every request under a kvlens cache; `evaluate`
(`kvlens.eval.run`) wraps `lm_eval.simple_evaluate` for `kvlens eval`; `kvlens.eval.shipped` writes the small
tasks kvlens ships. `require_lm_eval()` refuses, in one sentence, an install without the extra.
"""

from __future__ import annotations

import importlib.util

from kvlens.errors import KvlensError


def require_lm_eval() -> None:
    """Refuse, in one sentence, when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise KvlensError(
            "kvlens eval needs lm-evaluation-harness, the optional extra: pip install 'kvlens[eval]'."
        )
