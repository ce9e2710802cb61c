"""The experiment tests' model: the tiny model saved as a directory that every executor's workers can load."""
from __future__ import annotations

import pytest

from tests.conftest import tiny_model

# a haystack and a token count for the task suite's generator without a model (one token = one word)
ESSAY = " ".join(f"Chapter {i} tells how the miller walked to town with his {i} sacks of flour. "
                 f"The river was high that spring! Would the bridge hold again, he asked?" for i in range(40))


def words(text: str) -> int:
    return len(text.split())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny model saved as a model directory that `load_model` (and so every worker) can read:
    its weights plus a byte-level tokenizer (token id = byte value, as in the tests' ByteTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().model.save_pretrained(path)
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[255]).save_pretrained(path)
    return path
