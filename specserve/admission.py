"""Whom the scheduler may start without preempting later: room for the running sequences' growth.

Admitting a request as soon as its first prompt chunk fits (vLLM's way) fills a full pool with
prompts that the running sequences' next tokens then evict: the newest is preempted and computed
again from its first token, over and over (a memory-bound run of 64 long requests spent most of
its time recomputing). Here a waiting sequence starts only if the free pool also covers a share
of the tokens every running sequence may still emit, SGLang's "new token ratio": the share starts
at `INITIAL_RATIO` (times `schedule_conservativeness`), decays to `MIN_RATIO_FACTOR` of that over
`DECAY_STEPS` steps while nobody is preempted (replies usually end before max_tokens), and goes
back up when a preemption shows it was too low. Conservativeness 0 admits on the first chunk alone.

A reply counts as running at most as long as the longest of the last `RECENT_REPLIES` that ended
by themselves (SGLang: 4096 tokens, which is what counts before any has). A chat completion without
max_tokens may run to the context's end, yet most end within a few hundred tokens, and 4096 is a
large share of a CPU's pool: such clients would wait until the share had decayed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from specserve.sequence import Sequence

INITIAL_RATIO = 0.7
MIN_RATIO_FACTOR = 0.14
DECAY_STEPS = 600
RESUME_STEPS = 20  # after a preemption, each running sequence counts as needing at least this many more tokens
FIRST_REPLY_TOKENS = 4096  # how long a reply may run before any has ended
RECENT_REPLIES = 64


class NewTokenRatio:
    """The share of their remaining tokens that running sequences are expected to still need."""

    def __init__(self, conservativeness: float = 1.0):
        self.initial = min(1.0, INITIAL_RATIO * conservativeness)
        self.minimum = self.initial * MIN_RATIO_FACTOR
        self.value = self.initial
        self._replies: deque[int] = deque(maxlen=RECENT_REPLIES)  # lengths of replies that ended by themselves
        self._longest = FIRST_REPLY_TOKENS  # of those (read for every running sequence at every admission)

    @property
    def reserves(self) -> bool:
        return self.initial > 0

    def step(self) -> None:
        """A step went by: the share moves toward its minimum."""
        self.value = max(self.minimum, self.value - (self.initial - self.minimum) / DECAY_STEPS)

    def ended(self, seq: Sequence) -> None:
        """A sequence finished: its reply's length counts if the reply ended itself (EOS or a stop);
        one cut short by its max_tokens or an abort says nothing of how long replies run."""
        if seq.finish_reason == "stop":
            self._replies.append(len(seq.output_ids))
            self._longest = max(self._replies)

    def preempted(self, running: Iterable[Sequence]) -> None:
        """The pool ran out: expect at least what the survivors have emitted of their expected
        replies (plus `RESUME_STEPS` each), and never less than the initial share."""
        running = list(running)
        emitted = sum(len(s.output_ids) for s in running) + RESUME_STEPS * len(running)
        expected = sum(self._reply_tokens(s) for s in running) + 1
        self.value = min(1.0, max(self.value, self.initial, emitted / expected))

    def unreserved(self, seq: Sequence, allocated_slots: int) -> float:
        """The pool slots `seq` may still need beyond the `allocated_slots` its blocks hold: the
        rest of its tokens, and the share of the tokens it is expected to still emit."""
        to_come = self._reply_tokens(seq) - len(seq.output_ids)
        return max(0.0, seq.num_tokens + self.value * to_come - allocated_slots)

    def _reply_tokens(self, seq: Sequence) -> int:
        """How long `seq`'s reply may run: its max_tokens, at most the longest recent reply (while
        it is shorter than that, plus `RESUME_STEPS`)."""
        return min(seq.params.max_tokens, max(self._longest, len(seq.output_ids) + RESUME_STEPS))
