"""Drafter spec strings: one syntax for `--draft`, `LLM(draft=...)`, YAML configs and requests.

    none                   speculation off
    ngram                  prompt lookup (no weights)
    suffix[:TOKENS]        suffix decoding over the sequence and a cache of recent outputs of at most
                           TOKENS tokens (default 262144; 0: the sequence alone)
    early-exit[:K]         the target's first K layers + its norm and LM head (untrained)
    early-exit:PATH        a trained early-exit head (`specserve train-drafter --kind early-exit`)
    early-exit:trained     the trained early-exit head shipped for the target
    feature[:PATH]         an EAGLE-style feature head; without PATH the one shipped for the target
    replay:ALPHA           for benchmarks: the target's recorded continuation, each token kept with probability ALPHA
    NAME or PATH           a draft model sharing the target's tokenizer
    A+B                    several drafters, their trees merged into one
"""

from __future__ import annotations

from dataclasses import dataclass

KNOWN_KINDS = ("none", "ngram", "suffix", "early-exit", "feature", "replay")
SUFFIX_CACHE_TOKENS = 1 << 18  # the suffix drafter's cross-request cache by default: 1 MiB of int32 tokens
# (its array, holding forgotten outputs until packed, and the index of it: up to ~8 MiB, `OutputCache.nbytes`)


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # "ngram", "suffix", "early-exit", "early-exit-head", "feature", "replay" or "model"
    # suffix: cache tokens; early-exit: layers; heads: a path (None: the shipped head); model: name or path
    arg: str | None = None

    def __str__(self) -> str:
        if self.kind == "model":
            return str(self.arg)
        if self.kind == "early-exit-head":
            return f"early-exit:{self.arg or 'trained'}"
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"


def parse_spec(spec: str | None) -> list[DrafterSpec]:
    """The drafters a spec names, in order ([] for `none`). Raises ValueError saying what to write."""
    text = (spec or "none").strip()
    if text.lower() == "none":
        return []
    parts = [p.strip() for p in text.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"drafter spec {spec!r} has an empty part: join drafters with '+', e.g. ngram+early-exit:6")
    return [_parse_part(p, spec) for p in parts]


def _parse_part(part: str, spec: str) -> DrafterSpec:
    kind, _, arg = part.partition(":")
    kind = kind.lower()
    if kind == "none":
        raise ValueError(f"drafter spec {spec!r}: 'none' cannot be combined with other drafters")
    if kind == "ngram":
        if arg:
            raise ValueError(f"drafter spec {spec!r}: ngram takes no argument")
        return DrafterSpec("ngram")
    if kind == "suffix":
        if arg and not arg.isdigit():
            raise ValueError(f"drafter spec {spec!r}: suffix:TOKENS needs the cross-request cache's size in tokens, "
                             "e.g. suffix:65536 (suffix:0 drafts from the sequence alone)")
        return DrafterSpec("suffix", None if not arg or int(arg) == SUFFIX_CACHE_TOKENS else str(int(arg)))
    if kind == "early-exit":
        if arg == "trained":
            return DrafterSpec("early-exit-head")
        if arg and not arg.isdigit():  # a trained head's directory
            return DrafterSpec("early-exit-head", arg)
        if arg and int(arg) < 1:
            raise ValueError(f"drafter spec {spec!r}: early-exit:K needs a positive number of layers K")
        return DrafterSpec("early-exit", arg or None)
    if kind == "feature":
        return DrafterSpec("feature", arg or None)
    if kind == "replay":
        try:
            alpha = float(arg)
        except ValueError:
            alpha = -1.0
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"drafter spec {spec!r}: replay:ALPHA needs an acceptance ALPHA in [0, 1], "
                             "e.g. replay:0.8")
        return DrafterSpec("replay", f"{alpha:g}")
    return DrafterSpec("model", part)
