"""Drafters: everything that proposes token trees (n-gram lookup, draft models, early-exit heads).

One interface (`drafters.base.Drafter`): a step's `DraftRequest`s in, one `Draft` (a
`specserve.tree.TokenTree` rooted at the request's last token, plus draft distributions
where children were sampled) per request out. `build_drafter` turns a spec string
(`drafters.spec`) into a drafter.
"""

from __future__ import annotations

from drafters.base import Draft, Drafter, DraftRequest
from drafters.spec import DrafterSpec, parse_spec

__all__ = ["Draft", "Drafter", "DraftRequest", "DrafterSpec", "build_drafter", "parse_spec"]


def build_drafter(spec: str | None) -> Drafter | None:
    """The drafter a spec string names (None for `none`)."""
    parts = parse_spec(spec)
    if not parts:
        return None
    drafters = [_build_one(p) for p in parts]
    if len(drafters) == 1:
        return drafters[0]
    from drafters.merge import MergedDrafter

    return MergedDrafter(drafters)


def _build_one(part: DrafterSpec) -> Drafter:
    if part.kind == "ngram":
        from drafters.ngram import NgramDrafter

        return NgramDrafter()
    raise ValueError(f"drafter {str(part)!r}: only 'ngram' (and 'none') are available in this version; "
                     "draft models and early exit are being built")
