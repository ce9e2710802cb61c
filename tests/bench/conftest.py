"""The task suite's generator without a model: a haystack and a token count."""

from __future__ import annotations

# a haystack and a token count for the task suite's generator without a model (one token = one word)
ESSAY = " ".join(
    f"Chapter {i} tells how the miller walked to town with his {i} sacks of flour. "
    f"The river was high that spring! Would the bridge hold again, he asked?"
    for i in range(40)
)


def words(text: str) -> int:
    return len(text.split())
