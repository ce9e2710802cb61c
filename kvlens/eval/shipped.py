"""The lm-eval tasks kvlens ships: small YAML tasks over data generated from the bundled speeches.

`kvlens_passkey` (generate_until, exact match of the first number answered) hides a five-digit pass key in an
excerpt of a speech and asks for it; `kvlens_cloze` (multiple choice, acc and acc_norm) asks for an excerpt's
next word among four of the speech's words. The YAML files in `task_files/` are lm-eval task configs
(`dataset_path: json`) whose `data_files` name `@DATA@`; `write_tasks(folder)` writes the data (JSON lines,
the same on every machine) and the YAML files with `@DATA@` set to that folder, ready for lm-eval's
`TaskManager(include_path=folder)`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from kvlens import texts

TEMPLATES = Path(__file__).parent / "task_files"
TASKS = ("kvlens_passkey", "kvlens_cloze")
EXCERPT = 1000  # characters of each speech's excerpt (about 210 tokens: snapkv at ratio 0.5 keeps its 65)


def _excerpt(text: str, start: int) -> str:
    """`EXCERPT` characters of `text` from the word boundary at or after `start`."""
    text = " ".join(text.split())
    begin = text.find(" ", start) + 1
    return text[begin : begin + EXCERPT].rsplit(" ", 1)[0]


def passkey_docs() -> list[dict]:
    """One document per bundled speech: `{"context", "question", "answer"}`, the key at a seeded depth."""
    docs = []
    for i, text in enumerate(texts.bundled().values()):
        rng = random.Random(i)
        key = str(rng.randint(10000, 99999))
        words = _excerpt(text, 1000).split(" ")
        at = rng.randint(1, len(words) - 1)
        needle = f"The pass key is {key}. Remember it: {key} is the pass key."
        context = " ".join([*words[:at], needle, *words[at:]])
        docs.append({"context": context, "question": "What is the pass key?", "answer": key})
    return docs


def cloze_docs() -> list[dict]:
    """One document per bundled speech: `{"context", "choices", "label"}`, the true next word at a seeded
    place among three other words of the speech."""
    docs = []
    for i, text in enumerate(texts.bundled().values()):
        rng = random.Random(1000 + i)
        words = [w for w in _excerpt(text, 2000).split(" ") if w]
        cut = len(words) - 1
        truth = words[cut]
        others = sorted({w for w in words if re.fullmatch(r"[A-Za-z]+", w) and w != truth})
        choices = rng.sample(others, 3)
        label = rng.randint(0, 3)
        choices.insert(label, truth)
        docs.append({"context": " ".join(words[:cut]), "choices": choices, "label": label})
    return docs


def write_tasks(folder: str | Path) -> Path:
    """The shipped tasks' data and YAML files, written into `folder` (created); returns it."""
    out = Path(folder).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in (("kvlens_passkey", passkey_docs()), ("kvlens_cloze", cloze_docs())):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        template = (TEMPLATES / f"{name}.yaml").read_text(encoding="utf-8")
        (out / f"{name}.yaml").write_text(template.replace("@DATA@", out.as_posix()), encoding="utf-8")
    return out
