"""The one JSON-lines reader: samples files, kvpress files and the streams of a run cut short."""

from __future__ import annotations

import pytest

from kvlens.errors import KvlensError
from kvlens.jsonl import json_lines


def test_lines_end_at_newlines_only_and_keep_their_numbers_in_the_file():
    text = '{"a": "one\u2028two"}\n\n  \n{"b": 2}\r\n'  # U+2028 inside a string; blank lines skipped
    assert json_lines(text) == [(1, {"a": "one\u2028two"}), (4, {"b": 2})]


def test_a_line_that_is_not_json_is_named_by_its_number_in_the_file():
    with pytest.raises(KvlensError, match=r"^Line 3 of f\.jsonl is not valid JSON \(Expecting value\)\.$"):
        json_lines('{"a": 1}\n\nnot json\n{"b": 2}\n', "f.jsonl")


def test_a_last_line_cut_short_is_left_out_only_when_asked_and_only_the_last():
    text = '{"a": 1}\n{"b": 2}\n{"c": \n\n'
    assert json_lines(text, cut_short=True) == [(1, {"a": 1}), (2, {"b": 2})]
    with pytest.raises(KvlensError, match="Line 3 of"):
        json_lines(text)
    with pytest.raises(KvlensError, match="Line 1 of"):  # not the last line: refused even so
        json_lines('{"a": \n{"b": 2}\n', cut_short=True)
