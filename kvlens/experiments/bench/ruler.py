"""RULER-style synthetic long-context tasks, generated offline from a seed, and their scoring.

After RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", github.com/NVIDIA/RULER, Apache-2.0): its synthetic.yaml defaults for seven tasks. The
preambles, the needle sentence, the questions and the noise haystack are RULER's templates
(scripts/data/synthetic/constants.py), NVIDIA's text; the code here is kvlens's own.

What differs from RULER:
- A sample fills `length - 64` tokens of the caller's tokenizer with context and its longest question
  (the 64 leave room for the chat template); RULER counts the whole prompt plus the answer tokens.
- There is no answer prefix ("The special magic numbers for ... are") and no one-shot example (vt, cwe).
- `niah_single` alternates RULER's niah_single_1 (noise haystack, even `index`) and niah_single_2
  (essay haystack, odd `index`); the essay is the caller's `haystack_text`, not Paul Graham's essays.
- `niah_multiquery` asks its four keys as four questions, one after the other, not in one question.
- Needle keys are adjective-noun pairs from a small built-in list (RULER: the wonderwords lists).
- cwe draws its words from `haystack_text` (lowercase, 4+ letters), then from made-up syllable words
  when a long list needs more; below 4096 tokens it uses RULER's short setting (6 and 1 repeats), and
  3/1 or 2/1 repeats when even that does not fit.
- fwe's noise word is "...." (RULER writes '...' but its question says '....').
- Needle depths (`depths`): RULER puts each needle at a uniformly random sentence boundary (`random`, kvlens's
  samples before the option); `stratified` (the default) spreads the grid's `count` samples evenly over the
  context, sample i of n at a boundary drawn from the seed within [i/n, (i+1)/n) of the haystack's sentences,
  and the k needles (or vt's chain lines) of one sample each in their own k-th of it, so that a grid of 8
  samples does not leave the depth to luck. A line's depth is its boundary's index over the haystack's
  sentence count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlens.errors import KvlensError
from kvlens.jsonl import json_lines

CHAT_ROOM = 64  # tokens left for the chat template around context and question
# the suite's sample conventions (`kvlens bench tasks`'s defaults): generator seed, samples per task and
# length, chat template, needle depths, kept slots at a ratio (`kvlens.experiments.bench.tasks.slots_for`)
SUITE = {"seed": 0, "count": 8, "chat": True, "depths": "stratified", "rounding": "kvpress"}
# the conventions of a results file written before the `rounding` and `depths` options existed
IMPLIED = {"rounding": "kvlens", "depths": "random"}


@dataclass(frozen=True)
class TaskSpec:
    max_new_tokens: int  # RULER's answer-length limit (tokens_to_generate)
    description: str


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec(
        128, "one needle (a key's 7-digit number) in noise (even index) or essay (odd index)"
    ),
    "niah_multikey": TaskSpec(128, "four needles with different keys in the essay; one key asked"),
    "niah_multivalue": TaskSpec(128, "four numbers for one key in the essay; all four asked"),
    "niah_multiquery": TaskSpec(
        128, "four needles with different keys in the essay; four questions, one per key"
    ),
    "vt": TaskSpec(30, "variable tracking: a chain of four assignments in noise; all five variables asked"),
    "cwe": TaskSpec(120, "common words extraction: the ten words repeated most in a numbered list"),
    "fwe": TaskSpec(50, "frequent words extraction: the three most frequent coded words (Zipf, alpha 2)"),
}

NIAH_PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
CWE_PREAMBLE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
FWE_PREAMBLE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_NOISE = "...."

ADJECTIVES = (
    "grumpy",
    "brave",
    "calm",
    "eager",
    "fancy",
    "gentle",
    "happy",
    "jolly",
    "kind",
    "lively",
    "nice",
    "proud",
    "silly",
    "witty",
    "zealous",
    "ancient",
    "bitter",
    "bold",
    "bright",
    "clever",
    "cold",
    "curly",
    "dusty",
    "early",
    "fierce",
    "fuzzy",
    "giant",
    "golden",
    "hollow",
    "humble",
    "icy",
    "lazy",
    "loud",
    "lucky",
    "mighty",
    "noisy",
    "odd",
    "quiet",
    "rapid",
    "rusty",
    "shy",
    "sleepy",
    "smooth",
    "sour",
    "swift",
    "tall",
    "tiny",
    "wild",
)
NOUNS = (
    "pelican",
    "anchor",
    "badger",
    "beacon",
    "biscuit",
    "canyon",
    "castle",
    "comet",
    "cricket",
    "dolphin",
    "falcon",
    "fountain",
    "garden",
    "glacier",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "lemon",
    "meadow",
    "mirror",
    "monkey",
    "needle",
    "orchard",
    "otter",
    "parrot",
    "pepper",
    "pillow",
    "pumpkin",
    "rabbit",
    "river",
    "rocket",
    "saddle",
    "salmon",
    "shadow",
    "spider",
    "squirrel",
    "teapot",
    "thunder",
    "tiger",
    "tractor",
    "tulip",
    "violin",
    "walrus",
    "window",
    "zebra",
)
KEYS = tuple(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)
CWE_COMMON = 10  # RULER num_cw
DEPTHS = ("stratified", "random")
ZETA_2 = math.pi**2 / 6  # normalises RULER's Zipf counts at alpha = 2


@dataclass(frozen=True)
class Sample:
    """One task instance: `context` is compressed, then each question is asked from it.

    A generated context ends with a newline, so `context + question` reads as RULER's prompt.
    """

    task: str
    context: str
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]
    max_new_tokens: int
    # per expected answer, its needle's depth in a generated sample (None: no needles, or read from JSON)
    depths: tuple[tuple[float, ...], ...] | None = dataclasses.field(default=None, compare=False)
    answer_prefix: str = (
        ""  # the start of the assistant's turn, after the question (kvpress's `answer_prefix`)
    )
    # a kvpress benchmark sample: its dataset and what its metric reads besides the answers
    # (`kvlens.experiments.bench.kvpress_metrics`); None: RULER's string match
    kvpress: dict | None = dataclasses.field(default=None, compare=False)

    def to_json(self) -> dict:
        """`question` a string and `answers` a list for one question, lists of them for several.

        `max_new_tokens` is written only when it is not the task's default, so `from_json` restores it.
        """
        obj = {
            "task": self.task,
            "context": self.context,
            "question": list(self.questions),
            "answers": [list(a) for a in self.answers],
        }
        if len(self.questions) == 1:
            obj["question"], obj["answers"] = self.questions[0], list(self.answers[0])
        if self.max_new_tokens != _default_max_new_tokens(self.task):
            obj["max_new_tokens"] = self.max_new_tokens
        if self.answer_prefix:
            obj["answer_prefix"] = self.answer_prefix
        if self.kvpress is not None:
            obj["kvpress"] = self.kvpress
        return obj

    @classmethod
    def from_json(cls, obj: dict, line: int) -> Sample:
        """The sample of a JSON object (as `to_json` writes, or a user's line without `task`) on line
        `line`."""
        return cls._parse(obj, f"line {line}")

    @classmethod
    def _parse(cls, obj, where: str) -> Sample:
        bad = f"The sample on {where}"
        if not isinstance(obj, dict):
            raise KvlensError(f"{bad} is not a JSON object.")
        for field in ("context", "question", "answers"):
            if field not in obj:
                raise KvlensError(f"{bad} has no '{field}' field.")
        context, question, answers = obj["context"], obj["question"], obj["answers"]
        if not isinstance(context, str):
            raise KvlensError(f"{bad} has a 'context' that is not a string.")
        several = isinstance(question, list)
        questions, answer_lists = (question, answers) if several else ([question], [answers])
        if not questions or not all(isinstance(q, str) for q in questions):
            raise KvlensError(f"{bad} needs a 'question' that is a string or a non-empty list of strings.")
        if not (
            isinstance(answer_lists, list)
            and len(answer_lists) == len(questions)
            and all(isinstance(a, list) and a and all(isinstance(s, str) for s in a) for a in answer_lists)
        ):
            shape = "one non-empty list of strings per question" if several else "a non-empty list of strings"
            raise KvlensError(f"{bad} needs 'answers' to be {shape}.")
        task = obj.get("task", "custom")
        if not isinstance(task, str) or not task:
            raise KvlensError(f"{bad} has a 'task' that is not a non-empty string.")
        limit = obj.get("max_new_tokens", _default_max_new_tokens(task))
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise KvlensError(f"{bad} has a 'max_new_tokens' that is not a positive integer.")
        prefix, kvpress = obj.get("answer_prefix", ""), obj.get("kvpress")
        if not isinstance(prefix, str) or not (kvpress is None or isinstance(kvpress, dict)):
            raise KvlensError(
                f"{bad} has an 'answer_prefix' that is not a string or a 'kvpress' that is not an object."
            )
        answers_ = tuple(tuple(a) for a in answer_lists)
        return cls(task, context, tuple(questions), answers_, limit, answer_prefix=prefix, kvpress=kvpress)


def _default_max_new_tokens(task: str) -> int:
    return TASKS[task].max_new_tokens if task in TASKS else 64


def score(output: str, expected: Sequence[str]) -> float:
    """RULER's string_match_all: the share of `expected` found in `output`, ignoring case."""
    if not expected:
        raise KvlensError("A sample needs at least one expected answer to score.")
    text = output.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def score_sample(outputs: Sequence[str], sample: Sample) -> float:
    """Mean of `score` over the sample's questions, `outputs[i]` answering question i."""
    if len(outputs) != len(sample.questions):
        raise KvlensError(
            f"A {sample.task} sample has {len(sample.questions)} questions but got {len(outputs)} outputs."
        )
    return sum(score(o, a) for o, a in zip(outputs, sample.answers)) / len(outputs)


def needle_spans(sample: Sample) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of the needle sentences of the sample's expected answers in its context
    (the niah tasks'; none for other tasks)."""
    spans = []
    for value in dict.fromkeys(a for answers in sample.answers for a in answers):
        pattern = (
            re.escape(NEEDLE)
            .replace(re.escape("{key}"), r"[\w-]+")
            .replace(re.escape("{value}"), re.escape(value))
        )
        spans += [m.span() for m in re.finditer(pattern, sample.context)]
    return sorted(spans)


def read_samples(path) -> list[Sample]:
    """The samples of a JSON-lines file (blank lines skipped)."""
    return parse_lines(read_text(path), path)


def read_text(path) -> str:
    """A samples file's text (one clear sentence if it is missing or not UTF-8)."""
    path = Path(path)
    if not path.is_file():
        raise KvlensError(f"There is no samples file {path}.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvlensError(f"The samples file {path} is not UTF-8 text.") from None


def parse_lines(text: str, path="the samples file") -> list[Sample]:
    """The samples of JSON-lines `text` (from `path`, named in errors); blank lines skipped."""
    samples = [Sample._parse(obj, f"line {number} of {path}") for number, obj in json_lines(text, path)]
    if not samples:
        raise KvlensError(f"The samples file {path} has no samples.")
    return samples


def write_samples(samples, path) -> None:
    """Write `samples` as JSON lines (`Sample.to_json`), one a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in samples), encoding="utf-8"
    )


@functools.lru_cache(maxsize=4)
def _sentences(text: str) -> tuple[str, ...]:
    return tuple(s for s in re.split(r"(?<=[.?!])\s+", " ".join(text.split())) if s)


def _noise(n: int) -> list[str]:
    """`n` sentences of RULER's noise haystack."""
    units = _sentences(NOISE)
    return [units[i % len(units)] for i in range(n)]


def _essay(text: str, n: int) -> list[str]:
    """The first `n` sentences of `text`, repeated from its start when it runs out."""
    units = _sentences(text)
    if not units:
        raise KvlensError("This RULER task needs a haystack text with at least one sentence.")
    return [units[i % len(units)] for i in range(n)]


def _cuts(rng: random.Random, total: int, lines: int, stratum: tuple[int, int] | None) -> list[int]:
    """Sentence boundaries (0..`total`) for `lines` lines, ascending: uniformly random (`stratum` None,
    RULER's), or line j of sample i of n (`stratum` (i, n)) at a random boundary within [(j + i/n)/k, (j +
    (i+1)/n)/k) of the text (k = `lines`)."""
    if stratum is None:
        return sorted(rng.randint(0, total) for _ in range(lines))
    i, n = stratum
    cuts = []
    for j in range(lines):
        first = math.ceil((j * n + i) * total / (n * lines))
        last = math.ceil((j * n + i + 1) * total / (n * lines)) - 1
        cuts.append(
            rng.randint(first, last) if last >= first else min(first, total)
        )  # an empty stratum: its start
    return cuts


def _insert(
    rng: random.Random, sentences: list[str], lines: Sequence[str], stratum: tuple[int, int] | None
) -> tuple[str, list[float]]:
    """`sentences` joined by spaces, with `lines`, in their order, at the boundaries `_cuts` picks; and each
    line's depth (its boundary over the sentence count)."""
    cuts = _cuts(rng, len(sentences), len(lines), stratum)
    out, start = [], 0
    for cut, line in zip(cuts, lines):
        out += sentences[start:cut] + [line]
        start = cut
    return " ".join(out + sentences[start:]), [cut / max(len(sentences), 1) for cut in cuts]


def _niah(
    rng: random.Random,
    sentences: list[str],
    keys: int,
    values: int,
    asked: int,
    stratum: tuple[int, int] | None,
) -> tuple:
    """Needles for `keys` keys with `values` numbers each; questions on the first `asked` keys."""
    names = rng.sample(KEYS, keys)
    numbers = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), keys * values)]
    by_key = [numbers[i * values : (i + 1) * values] for i in range(keys)]
    needles = [(v, NEEDLE.format(key=k, value=v)) for k, vs in zip(names, by_key) for v in vs]
    rng.shuffle(needles)
    text, depths = _insert(rng, sentences, [line for _, line in needles], stratum)
    depth = {v: d for (v, _), d in zip(needles, depths, strict=True)}
    return (
        NIAH_PREAMBLE + text + "\n",
        tuple(NIAH_QUESTION.format(key=k) for k in names[:asked]),
        tuple(tuple(vs) for vs in by_key[:asked]),
        tuple(tuple(depth[v] for v in vs) for vs in by_key[:asked]),
    )


def _vt(rng: random.Random, n: int, stratum: tuple[int, int] | None) -> tuple:
    """One chain of four hops (five variables) in `n` noise sentences; variable k's depth is its line's."""
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = rng.randint(10_000, 99_999)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    text, depths = _insert(rng, _noise(n), chain, stratum)
    return VT_PREAMBLE + text + "\n", (VT_QUESTION.format(value=value),), (tuple(names),), (tuple(depths),)


@functools.lru_cache(maxsize=4)
def _text_words(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(re.findall(r"\b[a-z]{4,}\b", text)))


def _cwe_vocabulary(text: str, need: int) -> list[str]:
    """At least `need` distinct words: those of `text`, then made-up syllable words in a fixed order."""
    words = list(_text_words(text))
    seen, made = set(words), random.Random("kvlens/ruler/cwe-words")
    while len(words) < need:
        word = "".join(
            made.choice("bdfgklmnprstvz") + made.choice("aeiou") for _ in range(made.randint(3, 4))
        )
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _cwe(rng: random.Random, n: int, text: str, common: int, uncommon: int) -> tuple:
    """10 words `common` times each and `n` others `uncommon` times each, shuffled into a numbered list."""
    words = rng.sample(_cwe_vocabulary(text, CWE_COMMON + n), CWE_COMMON + n)
    listing = words[:CWE_COMMON] * common + words[CWE_COMMON:] * uncommon
    rng.shuffle(listing)
    context = CWE_PREAMBLE + " ".join(f"{i}. {w}" for i, w in enumerate(listing, 1)) + "\n"
    return context, (CWE_QUESTION,), (tuple(words[:CWE_COMMON]),), None


def _fwe(rng: random.Random, n: int, length: int) -> tuple:
    """RULER's Zipf text: word k of the vocabulary (k = 1 is the noise "....") `N / (k^2 zeta(2))` times.

    N = 100 + n, which keeps the three answers (ranks 2 to 4) strictly above rank 5.
    """
    coded: list[str] = []
    while len(coded) < max(length // 50, 5) - 1:  # RULER's vocabulary size, length // 50
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in coded:
            coded.append(word)
    vocabulary = [FWE_NOISE] + coded
    listing = [w for k, w in enumerate(vocabulary, 1) for _ in range(int((100 + n) / (k * k * ZETA_2)))]
    rng.shuffle(listing)
    return FWE_PREAMBLE + " ".join(listing) + "\n", (FWE_QUESTION,), (tuple(coded[:3]),), None


def _builders(
    task: str, length: int, index: int, text: str, stratum: tuple[int, int] | None
) -> list[Callable[[random.Random, int], tuple]]:
    """The ways to build `task` with `n` filler units, most faithful first (only cwe has more than one)."""
    if task == "niah_single":
        return [lambda rng, n: _niah(rng, _noise(n) if index % 2 == 0 else _essay(text, n), 1, 1, 1, stratum)]
    if task.startswith("niah_"):
        keys, values, asked = {
            "niah_multikey": (4, 1, 1),
            "niah_multivalue": (1, 4, 1),
            "niah_multiquery": (4, 1, 4),
        }[task]
        return [lambda rng, n: _niah(rng, _essay(text, n), keys, values, asked, stratum)]
    if task == "vt":
        return [functools.partial(_vt, stratum=stratum)]
    if task == "cwe":
        repeats = [(30, 3)] * (length >= 4096) + [(6, 1), (3, 1), (2, 1)]
        return [functools.partial(_cwe, text=text, common=c, uncommon=u) for c, u in repeats]
    return [functools.partial(_fwe, length=length)]


def _fit(
    build: Callable[[random.Random, int], tuple], key: str, count_tokens: Callable[[str], int], budget: int
) -> tuple | None:
    """`build` with the largest `n` whose context and longest question fit `budget` tokens; None if n = 0 does
    not.

    Every try starts from the same `random.Random(key)`, so the sample depends on `n` only.
    """

    def fitting(n: int) -> tuple | None:
        sample = build(random.Random(key), n)
        return sample if count_tokens(sample[0]) + max(map(count_tokens, sample[1])) <= budget else None

    best = fitting(0)
    if best is None:
        return None
    lo, hi = (
        0,
        1,
    )  # fitting(lo) holds; double hi until it does not (the cap: a unit can cost under a token), bisect
    while hi <= 4 * budget and (found := fitting(hi)) is not None:
        best, lo, hi = found, hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (found := fitting(mid)) is not None:
            best, lo = found, mid
        else:
            hi = mid
    return best


def generate(
    task: str,
    length: int,
    index: int,
    count_tokens: Callable[[str], int],
    haystack_text: str,
    seed: int = SUITE["seed"],
    depths: str = SUITE["depths"],
    count: int = SUITE["count"],
) -> Sample:
    """Sample `index` of `count` of `task` at `length` tokens: context plus longest question fill `length -
    64` tokens; its needles at `depths` (see the module docstring; `random` ignores `count`).

    Deterministic in (task, length, index, seed, depths, count); `count_tokens` is the caller's tokenizer.
    """
    if task not in TASKS:
        raise KvlensError(f"Unknown RULER task '{task}'; the tasks are {', '.join(TASKS)}.")
    if depths not in DEPTHS:
        raise KvlensError(f"Unknown needle depths '{depths}'; they are {', '.join(DEPTHS)}.")
    if depths == "stratified" and not 0 <= index < count:
        raise KvlensError(f"Sample index {index} is out of range for stratified depths over {count} samples.")
    stratum = (index, count) if depths == "stratified" else None
    for build in _builders(task, length, index, haystack_text, stratum):
        found = _fit(build, f"{task}/{length}/{index}/{seed}", count_tokens, length - CHAT_ROOM)
        if found is not None:
            context, questions, answers, depths = found
            return Sample(task, context, questions, answers, TASKS[task].max_new_tokens, depths)
    raise KvlensError(f"A length of {length} tokens is too small for a {task} sample; use a longer length.")
