"""RULER-style tasks without a model: generation (deterministic, fitting, answerable), scoring, JSON lines."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from kvlens.errors import KvlensError
from kvlens.experiments.bench import ruler
from kvlens.experiments.bench.ruler import (
    TASKS,
    Sample,
    generate,
    read_samples,
    score,
    score_sample,
    write_samples,
)
from tests.bench.conftest import ESSAY, words
from tests.conftest import TEST_DATA

SLACK = 16  # the most whitespace words one filler unit adds (a sentence, a list entry, a few Zipf words)
NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d{7})\.")


def size(sample: Sample) -> int:
    return words(sample.context) + max(words(q) for q in sample.questions)


def make(task: str, length: int = 1500, index: int = 0, seed: int = 0) -> Sample:
    return generate(task, length, index, words, ESSAY, seed)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [300, 1500, 5000])
def test_every_task_is_deterministic_and_fills_its_length(task, length):
    state = random.getstate()
    first = make(task, length, 3)
    assert random.getstate() == state  # the global RNG is never used
    assert make(task, length, 3) == first
    assert make(task, length, 4) != first and make(task, length, 3, seed=1) != first
    assert first.task == task and first.max_new_tokens == TASKS[task].max_new_tokens
    assert length - ruler.CHAT_ROOM - SLACK <= size(first) <= length - ruler.CHAT_ROOM
    assert len(first.answers) == len(first.questions) and all(first.answers)


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
@pytest.mark.parametrize("index", [0, 1])
def test_niah_needles_hold_exactly_the_answers(task, index):
    s = make(task, index=index)
    assert s.context.startswith(ruler.NIAH_PREAMBLE)
    needles = NEEDLE_RE.findall(s.context)
    keys = {k for k, _ in needles}
    assert len(needles) == (1 if task == "niah_single" else 4)
    assert len({v for _, v in needles}) == len(needles)
    assert len(keys) == (4 if task in ("niah_multikey", "niah_multiquery") else 1)
    for question, answers in zip(s.questions, s.answers):
        (key,) = [k for k in keys if f" for {k} mentioned" in question]
        assert sorted(v for k, v in needles if k == key) == sorted(answers)
        assert all(a in s.context for a in answers)
    assert len(s.answers[0]) == (4 if task == "niah_multivalue" else 1)


def test_niah_single_alternates_noise_and_essay():
    noise, essay = make("niah_single", index=2), make("niah_single", index=5)
    assert "The grass is green." in noise.context and "miller" not in noise.context
    assert "miller" in essay.context and "The grass is green." not in essay.context


def test_multiquery_asks_four_distinct_keys_one_answer_each():
    s = make("niah_multiquery")
    assert len(s.questions) == 4 and [len(a) for a in s.answers] == [1, 1, 1, 1]
    keys = [re.search(r"for (\S+) mentioned", q).group(1) for q in s.questions]
    assert len(set(keys)) == 4
    assert {(k, a[0]) for k, a in zip(keys, s.answers)} == set(NEEDLE_RE.findall(s.context))


def test_vt_chain_is_in_order_and_answers_all_its_variables():
    s = make("vt", index=7)
    chain = re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?(\w+)\.", s.context)
    names = [n for n, _ in chain]
    assert len(chain) == 5 and tuple(names) == s.answers[0] and len(set(names)) == 5
    assert chain[0][1].isdigit() and f"value {chain[0][1]} " in s.questions[0]
    assert all(ref == prev for (_, ref), prev in zip(chain[1:], names))
    assert "The grass is green." in s.context


@pytest.mark.parametrize("length, common", [(300, 6), (1500, 6), (5000, 30), (150, 2)])
def test_cwe_answers_are_the_true_top_ten(length, common):
    s = make("cwe", length)
    entries = re.findall(r"(\d+)\. (\S+)", s.context[len(ruler.CWE_PREAMBLE) :])
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    answers = s.answers[0]
    assert len(answers) == 10 and {counts[a] for a in answers} == {common}
    assert max(c for w, c in counts.items() if w not in answers) < common


@pytest.mark.parametrize("length", [300, 1500, 5000])
def test_fwe_answers_are_the_three_most_frequent_coded_words(length):
    s = make("fwe", length)
    counts = Counter(w for w in s.context[len(ruler.FWE_PREAMBLE) :].split() if w != ruler.FWE_NOISE)
    ranked = counts.most_common()
    assert {w for w, _ in ranked[:3]} == set(s.answers[0])
    assert ranked[2][1] > ranked[3][1]
    assert s.context.split().count(ruler.FWE_NOISE) > ranked[0][1]  # the noise word is the most frequent


def test_generate_rejects_unknown_tasks_short_lengths_and_missing_haystack():
    with pytest.raises(KvlensError, match="niah_single, niah_multikey.*fwe"):
        generate("qa_1", 1000, 0, words, ESSAY)
    with pytest.raises(KvlensError, match="too small for a niah_multikey"):
        generate("niah_multikey", 120, 0, words, ESSAY)
    with pytest.raises(KvlensError, match="haystack text"):
        generate("niah_multivalue", 1000, 0, words, "")


def test_score_is_the_share_found_ignoring_case():
    assert score("The numbers are 1234567 and ABCDE.", ["1234567", "abcde", "7654321", "QQQQQ"]) == 0.5
    assert score("nothing here", ["1234567"]) == 0.0
    assert score("Grumpy words: apple", ["APPLE"]) == 1.0
    sample = Sample("niah_multiquery", "ctx", ("q1", "q2"), (("111",), ("222", "333")), 128)
    assert score_sample(["111", "333"], sample) == pytest.approx(0.75)
    with pytest.raises(KvlensError, match="2 questions but got 1"):
        score_sample(["111"], sample)


def test_samples_round_trip_through_json_lines(tmp_path):
    samples = [make(t, 400, i) for i, t in enumerate(TASKS)]
    samples.append(Sample("custom", "ctx", ("q?",), (("a",),), 17))
    path = tmp_path / "sub" / "samples.jsonl"
    write_samples(samples, path)
    assert read_samples(path) == samples
    single, multi = make("vt", 400).to_json(), make("niah_multiquery", 400).to_json()
    assert set(single) == {"task", "context", "question", "answers"}
    assert isinstance(single["question"], str) and isinstance(single["answers"][0], str)
    assert isinstance(multi["question"], list) and isinstance(multi["answers"][0], list)


def test_a_users_line_needs_only_context_question_and_answers():
    s = Sample.from_json({"context": "c", "question": "q", "answers": ["x", "y"]}, 1)
    assert s == Sample("custom", "c", ("q",), (("x", "y"),), 64)
    line = {"context": "c", "question": "q", "answers": ["x"]}
    assert Sample.from_json({**line, "max_new_tokens": 9}, 1).max_new_tokens == 9
    assert Sample.from_json({**line, "task": "vt"}, 1).max_new_tokens == 30


@pytest.mark.parametrize(
    "obj, problem",
    [
        ({"context": "c", "question": "q"}, "no 'answers' field"),
        ({"question": "q", "answers": ["a"]}, "no 'context' field"),
        ({"context": "c", "question": "q", "answers": "a"}, "'answers' to be a non-empty list of strings"),
        (
            {"context": "c", "question": ["q1", "q2"], "answers": [["a"]]},
            "one non-empty list of strings per question",
        ),
        ({"context": 3, "question": "q", "answers": ["a"]}, "'context' that is not a string"),
        ({"context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 0}, "'max_new_tokens'"),
        (["not", "an", "object"], "not a JSON object"),
    ],
)
def test_a_bad_line_is_named(tmp_path, obj, problem):
    with pytest.raises(KvlensError, match="on line 7 (has|needs|is) ") as err:
        Sample.from_json(obj, 7)
    assert problem in str(err.value)
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"context": "c", "question": "q", "answers": ["a"]}) + "\n\n" + json.dumps(obj) + "\n"
    )
    with pytest.raises(KvlensError, match=f"line 3 of {re.escape(str(path))}"):
        read_samples(path)


def test_unreadable_files_are_named(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"context": "c", "question": "q", "answers": ["a"]}\n{"context": "c",\n')
    with pytest.raises(KvlensError, match="Line 2 of .*s.jsonl is not valid JSON"):
        read_samples(path)
    path.write_text("\n  \n")
    with pytest.raises(KvlensError, match="has no samples"):
        read_samples(path)
    with pytest.raises(KvlensError, match="There is no samples file"):
        read_samples(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"])
@pytest.mark.parametrize("count", [4, 8])
def test_stratified_depths_put_sample_i_of_n_in_its_stratum_each_needle_in_its_share(task, count):
    """Needle j of k of sample i of n lies at depth [(j + i/n)/k, (j + (i+1)/n)/k), where the context holds
    it."""
    for i in range(count):
        sample = generate(task, 1500, i, words, ESSAY, 0, count=count)
        assert sample == generate(task, 1500, i, words, ESSAY, 0, count=count)  # deterministic from the seed
        assert sample.depths == generate(task, 1500, i, words, ESSAY, 0, count=count).depths
        if task == "vt":
            lines = [f"VAR {sample.answers[0][0]} ="] + [f"VAR {v} = VAR" for v in sample.answers[0][1:]]
        else:
            lines = [f"is: {v}." for answers in sample.answers for v in answers]
        found = dict(zip(lines, (d for ds in sample.depths for d in ds), strict=True))
        order = sorted(found, key=lambda line: sample.context.index(line))  # the needles in context order
        assert [found[line] for line in order] == sorted(found.values())
        k = {"niah_single": 1, "niah_multiquery": 4, "vt": 5}.get(task, 4)
        if task == "niah_multikey":  # one key of four asked: its needle is one of the four shares
            j = int(found[order[0]] * k)
            assert (j + i / count) / k <= found[order[0]] < (j + (i + 1) / count) / k
            continue
        for j, line in enumerate(order):
            assert (j + i / count) / k <= found[line] < (j + (i + 1) / count) / k
    first = [generate("niah_single", 1500, i, words, ESSAY, 0).depths for i in range(8)]
    assert first != [
        generate("niah_single", 1500, i, words, ESSAY, 1).depths for i in range(8)
    ]  # jittered by seed


def test_stratified_depths_are_checked():
    with pytest.raises(KvlensError, match="out of range"):
        generate("niah_single", 600, 8, words, ESSAY, 0, count=8)
    with pytest.raises(KvlensError, match="Unknown needle depths 'even'"):
        generate("niah_single", 600, 0, words, ESSAY, 0, depths="even")


def test_random_depths_reproduce_the_samples_made_before_stratified_depths_byte_for_byte(tmp_path):
    """tests/data/ruler_random_samples.jsonl: written by the generator before the `depths` option."""
    old = (TEST_DATA / "ruler_random_samples.jsonl").read_text(encoding="utf-8")
    cases = [
        ("niah_single", 300, 0, 0),
        ("niah_single", 300, 1, 0),
        ("niah_multivalue", 300, 1, 0),
        ("vt", 300, 2, 1),
    ]
    write_samples(
        [generate(t, n, i, words, ESSAY, s, depths="random") for t, n, i, s in cases], tmp_path / "s.jsonl"
    )
    assert (tmp_path / "s.jsonl").read_text(encoding="utf-8") == old
    assert [generate(t, n, i, words, ESSAY, s, depths="random") for t, n, i, s in cases] != [
        generate(t, n, i, words, ESSAY, s) for t, n, i, s in cases
    ]
