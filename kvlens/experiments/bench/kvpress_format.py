"""kvpress's benchmark files read as they are: `.parquet` or JSON lines with kvpress's columns.

NVIDIA kvpress's `evaluation/` datasets (RULER, LongBench, InfiniteBench, needle in a haystack, ...) hold one
row per question: `context`, `question`, `answer_prefix`, `answer` or `answers` (a list of strings),
`max_new_tokens`, `task`, and what a task's metric reads (`all_classes`, `needle`). kvpress's
`evaluate.py` groups the rows by context and asks every question of a context from that context's one
compressed cache; here each (task, context) group becomes one `ruler.Sample` of several questions, its
`answer_prefix` starting the assistant's turn after the question (kvpress's pipeline:
`question + question_suffix + answer_prefix`), its `max_new_tokens` the group's largest, and its `kvpress`
field the dataset and each row's columns its metric reads (`kvlens.experiments.bench.kvpress_metrics`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlens.errors import KvlensError
from kvlens.experiments.bench import kvpress_metrics, ruler
from kvlens.jsonl import json_lines

REQUIRED = ("context", "question", "answer_prefix", "max_new_tokens", "task")


def is_kvpress(path: str | Path) -> bool:
    """Whether a samples file is in kvpress's format: a parquet file, or JSON lines whose first object has
    `answer_prefix` (kvlens's own samples have none)."""
    path = Path(path)
    if path.suffix == ".parquet":
        return True
    first = next((line for line in ruler.read_text(path).split("\n") if line.strip()), "")
    try:
        return "answer_prefix" in json.loads(first)
    except (json.JSONDecodeError, TypeError):
        return False


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a kvpress file, each a dict of plain Python values."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd

        if not path.is_file():
            raise KvlensError(f"There is no samples file {path}.")
        try:
            frame = pd.read_parquet(path)
        except (OSError, ValueError) as err:
            raise KvlensError(
                f"{path} is not a readable parquet file ({str(err).splitlines()[0]})."
            ) from None
        return [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]
    return [row for _, row in json_lines(ruler.read_text(path), path)]


def _plain(value):
    """numpy arrays (parquet's lists) as lists, numpy scalars as Python ones."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def samples(rows: list[dict], path: str | Path = "the samples file") -> list[ruler.Sample]:
    """One sample per (task, context), its rows' questions in file order; each mistake refused in one
    sentence, and a task whose metric needs a missing package refused before anything runs."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for number, row in enumerate(rows, 1):
        missing = [c for c in REQUIRED if c not in row] + (
            [] if "answer" in row or "answers" in row else ["answer or answers"]
        )
        if missing:
            raise KvlensError(
                f"Row {number} of {path} has no {', '.join(missing)} column (kvpress's format)."
            )
        groups.setdefault((str(row["task"]), str(row["context"])), []).append(row)
    if not groups:
        raise KvlensError(f"The samples file {path} has no samples.")
    out = []
    for (task, context), group in groups.items():
        dataset = kvpress_metrics.dataset_of(task, set(group[0]))
        kvpress_metrics.needed(dataset, task)
        answers = [_answers(row, path) for row in group]
        extra = [
            {k: row[k] for k in ("all_classes", "needle") if row.get(k) is not None}
            | {"question": row["question"] or row["context"]}
            for row in group
        ]
        obj = {
            "task": task,
            "context": context,
            "question": [str(row["question"]) for row in group],
            "answers": answers,
            "max_new_tokens": max(int(row["max_new_tokens"]) for row in group),
            "answer_prefix": str(group[0]["answer_prefix"] or ""),
            "kvpress": {"dataset": dataset, "extra": extra},
        }
        out.append(ruler.Sample._parse(obj, f"the {task} rows of {path}"))
    return out


def _answers(row: dict, path) -> list[str]:
    value = row.get("answers", row.get("answer"))
    listed = value if isinstance(value, list) else [value]
    if not listed or any(v is None for v in listed):
        raise KvlensError(f"A {row['task']} row of {path} has no expected answer.")
    return [str(v) for v in listed]


def to_jsonl(path: str | Path) -> str:
    """A kvpress file as kvlens's samples text (`ruler.parse_lines` reads it back)."""
    return "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in samples(read_rows(path), path))
