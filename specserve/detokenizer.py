"""From token ids to streamed text: UTF-8-safe incremental decoding and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class IncrementalDetokenizer:
    """Turns a token stream into text deltas, holding back incomplete UTF-8 characters.

    Decodes a short window (a few tokens of context + the unread tokens) so the cost per
    token stays constant, and emits only once the window no longer ends mid-character.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.ids = list((prompt_ids or [])[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""


class TextStream:
    """A sequence's output text, with stop strings found across token boundaries.

    Text that could be the start of a stop string is held back until the next tokens show
    whether it is one; a stop string and everything after it is never emitted.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = list(stop)
        self.text = ""  # emitted so far
        self.pending = ""  # decoded, held back because it may begin a stop string

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return the text that may now be emitted and whether a stop string ended it."""
        self.pending += self.detokenizer.push(token)
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:  # a match cannot start in emitted text: any stop-string prefix there was held back
            return self._emit(min(hits)), True
        return self._emit(len(self.pending) - self._held_back()), False

    def flush(self) -> str:
        """Emit what was held back (the sequence ended without a stop string)."""
        return self._emit(len(self.pending))

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        delta, self.pending = self.pending[:upto], self.pending[upto:]
        self.text += delta
        return delta
