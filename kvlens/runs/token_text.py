"""Tokens as text, decoded jointly: a byte-level BPE piece may hold part of a character (an emoji, a Hebrew,
Chinese or Polish letter), so a token is never decoded alone. The tokens' bytes are joined and decoded once;
each token's character span comes from its byte offsets in that text, and a token whose bytes share a
character with a neighbour gets the span of the whole group (and is marked `shared`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from kvlens.runs.meta import RunMeta

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_of_symbol() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: {symbol: the byte it stands for}."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = dict(zip(keep, keep))
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + extra
            extra += 1
    return {chr(s): b for b, s in symbols.items()}


def symbol_of_byte(byte: int) -> str:
    """The byte-level symbol standing for `byte` (`token_bytes`'s inverse)."""
    return _symbol_of_byte()[byte]


@cache
def _symbol_of_byte() -> dict[int, str]:
    return {b: s for s, b in _byte_of_symbol().items()}


def token_bytes(token: str) -> bytes:
    """The bytes a tokenizer's token string stands for: GPT-2 byte-level symbols (`Ġof` -> b' of'), else
    SentencePiece text (`▁` a space, `<0xE2>` one byte)."""
    fallback = _BYTE_FALLBACK.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    table = _byte_of_symbol()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.replace("▁", " ").encode("utf-8")


def _length(lead: int) -> int:
    """How many bytes a UTF-8 character starting with byte `lead` has (0: no character starts with it)."""
    for n, (shift, pattern) in enumerate(((7, 0), (5, 6), (4, 14), (3, 30)), start=1):
        if lead >> shift == pattern:
            return n
    return 0


def _chars(data: bytes) -> list[tuple[int, int, str]]:
    """(first byte, end byte, character) of each UTF-8 character of `data`; a byte that starts no valid
    character is one U+FFFD."""
    out, i = [], 0
    while i < len(data):
        n = _length(data[i])
        try:
            # a byte that starts no character (n = 0), or one cut short by the end, does not decode
            char = data[i : i + max(n, 1)].decode("utf-8")
        except UnicodeDecodeError:
            char = None
        if char is None:
            out.append((i, i + 1, "\ufffd"))
            i += 1
        else:
            out.append((i, i + n, char))
            i += n
    return out


@dataclass(frozen=True)
class TokenText:
    """`text`: the tokens decoded together; `spans[i]`: the (start, end) characters token i shows (its
    group's, when it shares a character with a neighbour); `parts[i]`: (k, n), token i is the k-th (from 1)
    of the n tokens of its group (n = 1: a token of whole characters)."""

    text: str
    spans: list[tuple[int, int]]
    parts: list[tuple[int, int]]

    def piece(self, i: int) -> str:
        """What token i shows: its characters, or its group's when it holds part of one."""
        start, end = self.spans[i]
        return self.text[start:end]

    def label(self, i: int) -> str:
        """`piece(i)`, marked `(k/n)` when token i is the k-th of n tokens sharing a character."""
        k, n = self.parts[i]
        return self.piece(i) if n == 1 else f"{self.piece(i)} ({k}/{n})"

    def flow(self, i: int) -> str:
        """Token i's share of the running text: its group's characters at the group's first token, nothing at
        the others (so that joining every token's flow gives `text`)."""
        return self.piece(i) * (self.parts[i][0] == 1)

    def before(self, i: int) -> str:
        """The text before token i (all of it for i = number of tokens)."""
        return self.text[: self._start(i)]

    def after(self, i: int) -> str:
        """The text from token i on."""
        return self.text[self._start(i) :]

    def _start(self, i: int) -> int:
        """The first character token i shows (the text's end past the last token)."""
        return self.spans[i][0] if i < len(self.spans) else len(self.text)


def decode(tokens: list[str]) -> TokenText:
    """Tokenizer token strings (`convert_ids_to_tokens`) decoded jointly, each mapped to its characters."""
    pieces = [token_bytes(str(t)) for t in tokens]
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    chars = _chars(b"".join(pieces))
    inside = {b for first, end, _ in chars for b in range(first + 1, end)}  # bytes that continue a character
    groups: list[list[int]] = []
    for i in range(len(pieces)):
        if groups and starts[i] in inside:
            groups[-1].append(i)
        else:
            groups.append([i])
    char_at = {first: k for k, (first, _, _) in enumerate(chars)}
    spans: list[tuple[int, int]] = [(0, 0)] * len(pieces)
    parts: list[tuple[int, int]] = [(1, 1)] * len(pieces)
    for group in groups:
        span = (char_at.get(starts[group[0]], len(chars)), char_at.get(starts[group[-1] + 1], len(chars)))
        for k, i in enumerate(group):
            spans[i], parts[i] = span, (k + 1, len(group))
    return TokenText("".join(c for _, _, c in chars), spans, parts)


def generated(meta: RunMeta) -> TokenText:
    """A run's generated (or scored) tokens (`meta.token_strings`) decoded jointly."""
    return decode(meta.token_strings)


def context(meta: RunMeta) -> TokenText:
    """A run's prompt and generated tokens decoded jointly, position by position."""
    return decode(meta.prompt_token_strings + meta.token_strings)
