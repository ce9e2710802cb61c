"""docs/policies.md and the README's policy table: from the policy registry (`kvlens.policies`) and the
kvpress cross-check's reference file (`tests/data/kvpress_reference.json`, which names the policies it
compares)."""

from __future__ import annotations

import inspect
import json
import re
import sys

from docgen.common import ROOT, banner, table

REFERENCE = ROOT / "tests" / "data" / "kvpress_reference.json"


def crosschecked() -> dict[str, str]:
    """Policy name -> what the kvpress cross-check compares for it."""
    ref = json.loads(REFERENCE.read_text(encoding="utf-8"))
    out = {c["policy"]: "the prompt's compression and every decode step" for c in ref["cases"].values()}
    for c in ref["prompt_cases"].values():
        out.setdefault(c["policy"], "the prompt's compression")
    return out


def kvpress_version() -> str:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))["versions"]["kvpress"]


def paper_link(url: str) -> str:
    if not url:
        return "—"
    arxiv = re.search(r"arxiv\.org/abs/([\d.]+)", url)
    return f"[arXiv {arxiv.group(1)}]({url})" if arxiv else f"[paper]({url})"


def docstrings(cls) -> str:
    """The policy's module docstring (paper and rule) and its class docstring (choices), as markdown."""
    module = inspect.getdoc(sys.modules[cls.__module__]) or ""
    own = inspect.getdoc(cls) or ""
    if own.startswith(cls.__name__ + "("):  # the dataclass' generated signature, not a docstring
        own = ""
    return "\n\n".join(p for p in (module, own) if p) + "\n\n"


def short_params(name: str) -> str:
    from kvlens.policies import policy_class

    parts = [f"{p.name}={p.describe()['default']}" for p in policy_class(name).declared()]
    return ", ".join(parts) or "—"


def value_range(d: dict) -> str:
    if d["choices"]:
        return ", ".join(f"`{c}`" for c in d["choices"])
    low, high = d["minimum"], d["maximum"]
    if low is None and high is None:
        return ""
    if high is None:
        return f"≥ {low}"
    return f"≤ {high}" if low is None else f"{low} to {high}"


def properties(cls) -> str:
    from kvlens.policies import family

    props = [f"Family: **{family(cls)}**"]
    defaults = cls()
    if defaults.budget_free:
        props.append("budget-free (decides its own size)")
    if defaults.competes != "head":
        props.append("layers or heads keep different counts (their total is the budget's)")
    if cls.chunked_prefill:
        props.append("accepts `--prefill-chunk`")
    if cls.merge_rule:
        props.append(f"merge rule replayed by provenance: `{cls.merge_rule}`")
    return "; ".join(props) + ".\n\n"


def kvpress_line(name: str, cls, checked: dict[str, str]) -> str:
    if not cls.kvpress:
        return "**kvpress**: no equivalent press.\n\n"
    out = f"**kvpress**: `{cls.kvpress}`"
    test = "tests/cross_checks/test_kvpress_crosscheck.py"
    out += (
        f", cross-checked on {checked[name]} (`{test}`, kvpress {kvpress_version()})"
        if name in checked
        else ", not cross-checked"
    )
    out += f". {cls.kvpress_differs}\n\n" if cls.kvpress_differs else ".\n\n"
    return out


def section(name: str, checked: dict[str, str]) -> str:
    from kvlens.policies import parameters, policy_class, presets

    cls = policy_class(name)
    out = f"## {name}\n\n{cls.description}\n\n**Paper**: {paper_link(cls.paper)}. " + properties(cls)
    out += docstrings(cls)
    params = parameters(name)
    if params:
        rows = []
        for p in params:
            d = p.describe()
            rows.append([f"`{d['name']}`", f"`{d['default']}`", value_range(d), d["help"]])
        out += table(["parameter", "default", "range", "what it sets"], rows) + "\n"
    else:
        out += "No parameters.\n\n"
    for preset, settings in presets(name).items():
        values = ", ".join(f"{k}={v}" for k, v in settings.items())
        out += f"- preset `{preset}`: {values}\n"
    if presets(name):
        out += "\n"
    return out + kvpress_line(name, cls, checked)


def page() -> str:
    from kvlens.policies import policy_names

    checked = crosschecked()
    out = (
        banner("the policy registry (`kvlens.policies`) and `tests/data/kvpress_reference.json`")
        + "# Policies\n\n"
    )
    out += (
        "Every policy is one file in `kvlens/policies/`. `kvlens policies` lists them, `--set "
        "KEY=VALUE` changes "
        "a parameter (`--set preset=NAME` applies a preset; explicit values override it) and the "
        "app's widgets "
        "take their tooltips from the same declarations. A policy built on a `base` policy (CaM, PyramidKV, "
        "Ada-KV) takes the base's parameters as `base.NAME`.\n\n"
    )
    out += readme_table() + "\n"
    for name in policy_names():
        out += section(name, checked)
    return out


def decode_protocol(name: str) -> str:
    """How a policy decodes by default: its prompt compressed once (the cache then grows) or its budget kept
    at every step (`Needs.decode_steps`)."""
    from kvlens.policies import make_policy

    if name == "full":
        return "—"
    return "every step" if make_policy(name).needs().decode_steps else "prompt once"


def readme_table() -> str:
    """One line per policy: family, paper, parameters with defaults, decode protocol, kvpress equivalent,
    cross-checked."""
    from kvlens.policies import family, policy_class, policy_names

    checked = crosschecked()
    rows = []
    for name in policy_names():
        cls = policy_class(name)
        kvpress = f"`{cls.kvpress}`" if cls.kvpress else "—"
        crossed = "no" if cls.kvpress else "—"
        if name in checked:
            crossed = "yes"
        rows.append(
            [
                f"`{name}`",
                family(cls),
                paper_link(cls.paper),
                short_params(name),
                decode_protocol(name),
                kvpress,
                crossed,
            ]
        )
    header = ["policy", "family", "paper", "parameters (defaults)", "decoding", "kvpress", "cross-checked"]
    return table(header, rows)


def names() -> list[str]:
    from kvlens.policies import policy_names

    return policy_names()
