"""Record levels: how much a run records (no heavy imports, so run browsers can use it)."""

from __future__ import annotations

from enum import StrEnum

from kvlens.errors import KvlensError


class RecordLevel(StrEnum):
    """How much a run records; each level includes the ones before it."""

    SUMMARY = "summary"
    STATES = "states"
    ATTENTION = "attention"

    @classmethod
    def parse(cls, text: str) -> RecordLevel:
        """A level by name; `full`, its name in older runs, is `attention`."""
        name = {"full": "attention"}.get(text, text)
        if name not in cls._value2member_map_:
            raise KvlensError(f"Unknown record level '{text}'; choose one of: {', '.join(LEVELS)}.")
        return cls(name)

    def includes(self, other: RecordLevel | str) -> bool:
        """Whether a run recorded at this level has what `other` records."""
        return LEVELS.index(self) >= LEVELS.index(RecordLevel.parse(other))


LEVELS = tuple(RecordLevel)
