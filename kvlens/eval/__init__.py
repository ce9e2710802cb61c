"""kvlens in lm-evaluation-harness (lm-eval 0.4.x, the optional extra `kvlens[eval]`).

`kvlens.eval.KvlensLM` (`kvlens.eval.lm`, imported on first use) is lm-eval's HF model with every request
under a kvlens cache; `evaluate` (`kvlens.eval.run`) wraps `lm_eval.simple_evaluate` for `kvlens eval`;
`kvlens.eval.shipped` writes the small tasks kvlens ships. `require_lm_eval()` refuses, in one sentence, an
install without the extra.
"""

from __future__ import annotations

import importlib.util

from kvlens.errors import KvlensError
from kvlens.eval.offline import quiet_datasets


def require_lm_eval() -> None:
    """Refuse, in one sentence, when lm-eval is not installed; then keep its data loading off the network for
    local files (`quiet_datasets`)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise KvlensError(
            "kvlens eval needs lm-evaluation-harness, the optional extra: pip install 'kvlens[eval]'."
        )
    quiet_datasets()


def __getattr__(name: str):
    """`KvlensLM` on first use, refused in one sentence without the extra."""
    if name == "KvlensLM":
        require_lm_eval()
        from kvlens.eval.lm import KvlensLM

        return KvlensLM
    raise AttributeError(f"module 'kvlens.eval' has no attribute {name!r}")
