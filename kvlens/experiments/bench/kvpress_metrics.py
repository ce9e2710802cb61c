"""Each kvpress benchmark's own metric, per task, on a 0-1 scale (kvpress reports 100 times these).

Written after NVIDIA kvpress's `evaluation/benchmarks/*/calculate_metrics.py`:

- RULER: string match, `string_match_part` for the `qa_*` tasks (any expected answer found), else
  `string_match_all` (the share found), ignoring case.
- LongBench (`evaluation/benchmarks/longbench`, after THUDM/LongBench's `metrics.py`): the dataset's metric
  (QA F1, classification, passage retrieval or count, ROUGE-L with the `rouge` package, code similarity with
  `fuzzywuzzy`; Chinese tasks with `jieba`), the best over the expected answers; `trec`, `triviaqa`,
  `samsum` and `lsht` score the first line of the answer. A `-e` suffix names LongBench-E's same task.
- InfiniteBench (`evaluation/benchmarks/infinite_bench`, after OpenBMB/InfiniteBench's `compute_scores.py`):
  the task's scorer; `code_run`, `math_find`, `math_calc` compare numbers; `code_debug` and
  `longbook_choice_eng` take the option's text from the question's `A. ... D.` lines.
- Needle in a haystack (`evaluation/benchmarks/needle_in_haystack`): ROUGE-1 F of the answer against the
  needle (`rouge_score`, stemmed); kvpress multiplies it by 10.

`needed(dataset, task)` names the package a task's metric needs when it is missing, so a file is refused
before anything runs.
"""

from __future__ import annotations

import importlib.util
import re
import string
from collections import Counter
from collections.abc import Sequence

from kvlens.errors import KvlensError
from kvlens.experiments.bench import ruler

RULER = {
    *(f"niah_{kind}_{i}" for kind in ("single", "multikey") for i in (1, 2, 3)),
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
}
FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")
LONGBENCH_METRIC = {
    **dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"], "qa_f1"),
    "triviaqa": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge"),
    **dict.fromkeys(["dureader", "vcsum"], "rouge_zh"),
    **dict.fromkeys(["trec", "lsht"], "classification"),
    "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh",
    "passage_count": "count",
    **dict.fromkeys(["lcc", "repobench-p"], "code_sim"),
}
PACKAGES = {
    "rouge": ["rouge"],
    "rouge_zh": ["rouge", "jieba"],
    "qa_f1_zh": ["jieba"],
    "code_sim": ["fuzzywuzzy"],
}
INFINITEBENCH = {
    "kv_retrieval",
    "kv_retrieval_prefix",
    "kv_retrieval_both",
    "passkey",
    "number_string",
    "code_run",
    "code_debug",
    "longdialogue_qa_eng",
    "longbook_qa_eng",
    "longbook_choice_eng",
    "math_find",
    "math_calc",
}
ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
OPTIONS = re.compile(r"\nA\. (.*)\nB\. (.*)\nC\. (.*)\nD\. (.*)\Z")


def dataset_of(task: str, columns: set[str]) -> str:
    """The kvpress benchmark a task of a file belongs to (`needle` column: needle in a haystack)."""
    if "needle" in columns:
        return "needle_in_haystack"
    if task in RULER:
        return "ruler"
    if task.removesuffix("-e") in LONGBENCH_METRIC:
        return "longbench"
    if task in INFINITEBENCH:
        return "infinite_bench"
    raise KvlensError(
        f"kvlens does not know kvpress's metric for task '{task}' (RULER, LongBench, InfiniteBench and "
        f"needle-in-a-haystack tasks are scored)."
    )


def needed(dataset: str, task: str) -> None:
    """Refuse, in one sentence, a task whose metric needs a package that is not installed."""
    packages = {"needle_in_haystack": ["rouge_score"]}.get(dataset, [])
    if dataset == "longbench":
        packages = PACKAGES.get(LONGBENCH_METRIC[task.removesuffix("-e")], [])
    if task == "longbook_sum_eng":
        raise KvlensError("kvpress does not score InfiniteBench's longbook_sum_eng; leave it out.")
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise KvlensError(
            f"kvpress scores {task} with the {' and '.join(missing)} package(s); pip install "
            f"{' '.join(missing)} first."
        )


def score_sample(outputs: Sequence[str], sample: ruler.Sample) -> float:
    """The mean over the sample's questions of their metric (`ruler.score_sample` for kvlens's own)."""
    if sample.kvpress is None:
        return ruler.score_sample(outputs, sample)
    info = sample.kvpress
    scores = [
        score(info["dataset"], sample.task, out, list(answers), info.get("extra", [{}] * len(outputs))[i])
        for i, (out, answers) in enumerate(zip(outputs, sample.answers, strict=True))
    ]
    return sum(scores) / len(scores)


def score(dataset: str, task: str, output: str, answers: list[str], extra: dict) -> float:
    """One answer's score under kvpress's metric for `dataset` and `task`; `extra`: the row's other columns
    the metric reads (`all_classes`, `needle`, the question for its options)."""
    if dataset == "ruler":
        found = [a.lower() in output.lower() for a in answers]
        return float(any(found)) if task.startswith("qa") else sum(found) / len(found)
    if dataset == "longbench":
        name = task.removesuffix("-e")
        if name in FIRST_LINE:
            output = output.lstrip().split("\n")[0]
        return max(
            _longbench(LONGBENCH_METRIC[name], output, a, extra.get("all_classes") or []) for a in answers
        )
    if dataset == "infinite_bench":
        return float(_infinite(task, output, answers, extra.get("question", "")))
    from rouge_score import rouge_scorer

    return (
        rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
        .score(extra["needle"], output)["rouge1"]
        .fmeasure
    )


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def normalize_zh(text: str) -> str:
    """The Chinese normalisation: lower case, no ASCII or Chinese punctuation, no spaces."""
    punct = set(string.punctuation + ZH_PUNCTUATION)
    return "".join("".join(c for c in text.lower() if c not in punct).split())


def f1(prediction: list[str], truth: list[str]) -> float:
    """Token-overlap F1 of two token lists."""
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def _numbers_equal(output: str, wanted: str) -> float:
    """The share of the numbers in `output` that equal `wanted` (0 without numbers)."""
    numbers = re.findall(r"\d+", output)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def _longbench(metric: str, output: str, truth: str, classes: list[str]) -> float:
    if metric == "qa_f1":
        return f1(normalize(output).split(), normalize(truth).split())
    if metric == "count":
        return _numbers_equal(output, str(truth))
    if metric in ("retrieval", "retrieval_zh"):
        pattern = {"retrieval": r"Paragraph (\d+)", "retrieval_zh": r"段落(\d+)"}[metric]
        return _numbers_equal(output, re.findall(pattern, truth)[0])
    if metric == "classification":
        matched = [c for c in classes if c in output]
        matched = [c for c in matched if not (c in truth and c != truth)]
        return 1.0 / len(matched) if truth in matched else 0.0
    if metric == "code_sim":
        from fuzzywuzzy import fuzz

        lines = output.lstrip("\n").split("\n")
        first = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
        return fuzz.ratio(first, truth) / 100
    import jieba

    if metric == "qa_f1_zh":
        cut = lambda s: [t for t in (normalize_zh(w) for w in jieba.cut(s, cut_all=False)) if t]  # noqa: E731
        return f1(cut(output), cut(truth))
    if metric == "rouge_zh":
        output, truth = (" ".join(jieba.cut(s, cut_all=False)) for s in (output, truth))
    from rouge import Rouge

    try:
        return Rouge().get_scores([output], [truth], avg=True)["rouge-l"]["f"]
    except (ValueError, RecursionError):  # an empty hypothesis: kvpress scores it 0
        return 0.0


def _first_int(output: str) -> str:
    return next((part for part in re.split("[^0-9]", output) if part), "")


def _words(output: str, chars: str) -> list[str]:
    for c in chars:
        output = output.replace(c, " ")
    return output.split()


def _infinite(task: str, output: str, answers: list[str], question: str) -> float:
    """InfiniteBench's scorer of `task` (its `get_score_one_*`), the labels built as kvpress does."""
    label = answers[0]
    if task.startswith("kv_retrieval"):
        return float(label in _words(output, "\n:\"'.,?!{}"))
    if task in ("passkey", "number_string"):
        return float(label == _first_int(output))
    if task == "code_run":
        words = _words(output.strip(), "\n.`'\":")
        try:
            return float(bool(words) and int(words[-1]) == int(label))
        except ValueError:
            return 0.0
    if task in ("longbook_qa_eng",):
        return max(f1(normalize(output).split(), normalize(a).split()) for a in answers)
    if task == "longdialogue_qa_eng":
        return float(any(a.upper() in output.strip().upper() for a in answers))
    if task == "math_find":
        found = re.search(r"\d+\.\d+|\d+", output)
        value = float(label) if "." in label else int(label)
        return float(found is not None and type(value)(float(found.group(0))) == value)
    if task == "math_calc":
        wanted, got = [int(a) for a in answers], [int(p) for p in re.split("[^0-9]", output) if p]
        right = next((i for i, (w, g) in enumerate(zip(wanted, got)) if w != g), min(len(wanted), len(got)))
        return right / len(wanted)
    options = OPTIONS.search(question)
    if options is None:
        raise KvlensError(f"The {task} question has no A-D options to score its answer against.")
    text = options.group("ABCD".index(label) + 1)
    return float(_choice(task, output.strip(), [text, label]))


def _collapse(text: str, chars: list[str]) -> str:
    """`text` with each of `chars` replaced by a space, then runs of spaces made one (InfiniteBench's)."""
    for c in chars:
        text = text.replace(c, " ")
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def _after_prefix(text: str, prefixes: tuple[str, ...], starts: list[str]) -> bool | None:
    """Whether the text after the first of `prefixes` found starts with one of `starts` (None: none found)."""
    for prefix in prefixes:
        at = text.find(prefix)
        if at != -1:
            return len(text) >= at + len(prefix) + 1 and text[at + len(prefix) + 1 :].startswith(
                tuple(starts)
            )
    return None


def _choice(task: str, output: str, label: list[str]) -> bool:
    """`code_debug` and `longbook_choice_eng` (`label`: the option's text, its letter): the last standalone
    option letter, else the answer's start, else what follows an answer prefix."""
    letters = {"code_debug": "A-J"}.get(task, "A-D")
    found = re.search(rf"\b[{letters}]\b(?!.*\b[{letters}]\b)", output)
    if found and found.group(0) in (label[1:] if task == "code_debug" else label):
        return True
    if task == "code_debug":
        cleaned = _collapse(output, ["\n", "`", "'", '"', "-", "*", "Option", "option"])
        if cleaned.startswith((label[1], label[0])):
            return True
        prefixes = ("answer is:", "is:", "answer:", "correct option is:")
        return bool(_after_prefix(cleaned, prefixes, [label[1], label[0]]))
    if not output:
        return False
    if output[0] in "ABCD":
        return output[0] in label
    if output in label:
        return True
    cleaned = _collapse(output, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"])
    after = _after_prefix(cleaned, ("answer is:", "answer:", "answer is", "option is"), label)
    if after is not None:
        return after
    return next((w in label for w in cleaned.split() if w in "ABCD"), False)
