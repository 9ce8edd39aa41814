"""Drafters: everything that proposes token trees (n-gram lookup, draft models, early-exit heads).

One interface (`drafters.base.Drafter`): a step's `DraftRequest`s in, one `Draft` (a
`specserve.tree.TokenTree` rooted at the request's last token, plus draft distributions
where children were sampled) per request out. `build_drafter` turns a spec string
(`drafters.spec`) into a drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafters.base import Draft, Drafter, DraftRequest, DraftTarget
from drafters.spec import DrafterSpec, parse_spec

__all__ = ["Draft", "Drafter", "DraftRequest", "DraftTarget", "DrafterOptions", "DrafterSpec", "build_drafter",
           "parse_spec"]


@dataclass
class DrafterOptions:
    """How model drafters grow trees (see `drafters.tree_search`) and load weights."""

    top_k: int = 4  # children per expanded node
    beam: int = 4  # nodes expanded per draft forward; top_k = beam = 1 drafts a chain
    dtype: str | torch.dtype | None = None  # draft model weights (default: the target's)
    vocab: int | None = None  # draft models score only the first `vocab` token ids (see DraftModelDrafter)
    quantization: str | None = None  # draft models: "int8" projections (see DraftModelDrafter.load)
    # Unless `vocab` is given, draft models with more than twice this many tokens score this many
    # (the engine sets it on a CPU, where the LM head is a large share of a draft forward)
    default_vocab: int | None = None
    device: torch.device = torch.device("cpu")  # the target's: draft models and their K/V live there too
    load_format: str = "auto"  # draft models' weights, as the target's (`dummy`: random at their config's shape)


def build_drafter(spec: str | None, options: DrafterOptions | None = None,
                  build_part: Callable[[DrafterSpec], Drafter] | None = None) -> Drafter | None:
    """The drafter a spec string names (None for `none`). `build_part` builds each part (the
    engine passes one that reuses loaded draft models); by default `build_part_drafter`."""
    parts = parse_spec(spec)
    if not parts:
        return None
    options = options or DrafterOptions()
    drafters = [(build_part or (lambda p: build_part_drafter(p, options)))(p) for p in parts]
    if len(drafters) == 1:
        return drafters[0]
    from drafters.merge import MergedDrafter

    return MergedDrafter(drafters)


def build_part_drafter(part: DrafterSpec, options: DrafterOptions) -> Drafter:
    """One drafter of a spec: n-gram lookup, early exit, a trained head or a draft model (loaded here)."""
    if part.kind == "ngram":
        from drafters.ngram import NgramDrafter

        return NgramDrafter()
    if part.kind == "suffix":
        from drafters.suffix import SUFFIX_CACHE_TOKENS, SuffixDrafter

        return SuffixDrafter(SUFFIX_CACHE_TOKENS if part.arg is None else int(part.arg))
    if part.kind == "replay":
        from drafters.replay import ReplayDrafter

        return ReplayDrafter(float(part.arg), width=options.top_k)
    if part.kind in ("feature", "early-exit-head"):
        from drafters.heads import EarlyExitHeadDrafter, FeatureHeadDrafter

        head = FeatureHeadDrafter if part.kind == "feature" else EarlyExitHeadDrafter
        return head(part.arg, options.top_k, options.beam)
    if part.kind == "early-exit":
        from drafters.early_exit import EarlyExitDrafter

        return EarlyExitDrafter(None if part.arg is None else int(part.arg), options.top_k, options.beam)
    from drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter.load(str(part.arg), options.dtype, options.top_k, options.beam, options.vocab,
                                  options.quantization, options.default_vocab, options.device, options.load_format)
