"""Short human labels for policies and their parameters (no Streamlit)."""
from __future__ import annotations

from kvlens.errors import KvlensError
from kvlens.policies import parameters


def _norm(value):
    return list(value) if isinstance(value, (tuple, list)) else value  # run.json stores tuples as lists


def changed_params(policy: str, params: dict) -> dict:
    """The parameters that differ from the policy's defaults (all of them for an unknown policy)."""
    try:
        defaults = {p["name"]: p["default"] for p in parameters(policy, params)}
    except KvlensError:
        return dict(params)
    return {k: v for k, v in params.items() if k not in defaults or _norm(defaults[k]) != _norm(v)}
