"""Tokens decoded jointly: byte-level pieces that split a character become one marked group, never U+FFFD."""

from __future__ import annotations

import pytest

from kvlens.runs.token_text import decode, symbol_of_byte, token_bytes

MIXED = "Łódź 👧 שלום 你好世界 Ærø å!\n"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    import kvlens

    return AutoTokenizer.from_pretrained(kvlens.model_path())


def test_byte_level_and_sentencepiece_strings_become_bytes():
    assert [token_bytes(t) for t in ("Ġof", "Ċ", "▁the", "Hello", "<0xE2>")] == [
        b" of",
        b"\n",
        b" the",
        b"Hello",
        b"\xe2",
    ]


def test_a_mixed_script_text_decodes_as_the_tokenizer_does(tokenizer):
    ids = tokenizer(MIXED).input_ids
    text = decode(tokenizer.convert_ids_to_tokens(ids))
    assert text.text == tokenizer.decode(ids) == MIXED
    assert "".join(text.flow(i) for i in range(len(ids))) == MIXED
    assert all("\ufffd" not in text.piece(i) for i in range(len(ids)))
    split = [i for i in range(len(ids)) if text.parts[i][1] > 1]
    assert split, "the emoji and the Chinese characters span several byte-level tokens"
    for i in split:
        assert text.piece(i) in MIXED and text.label(i).endswith(f"({text.parts[i][0]}/{text.parts[i][1]})")


def test_a_character_split_across_two_tokens_is_shown_once_with_both():
    emoji = "👧".encode()
    text = decode([_symbols(b"a" + emoji[:2]), _symbols(emoji[2:] + b" b")])
    assert text.text == "a👧 b"
    assert text.piece(0) == text.piece(1) == "a👧 b" and text.parts == [(1, 2), (2, 2)]
    assert text.before(1) == "" and text.after(0) == "a👧 b"


def test_a_cut_character_at_the_end_is_one_replacement_per_byte():
    text = decode([_symbols(b"ok"), _symbols("你".encode()[:2])])
    assert text.text == "ok\ufffd\ufffd" and text.piece(0) == "ok" and text.parts == [(1, 1), (1, 1)]


def _symbols(data: bytes) -> str:
    """`data` in GPT-2's byte-level alphabet (what `convert_ids_to_tokens` returns)."""
    return "".join(symbol_of_byte(b) for b in data)
