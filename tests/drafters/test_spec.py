"""Drafter spec strings: one syntax everywhere, and errors that say what to write."""

from __future__ import annotations

import pytest

from drafters import build_drafter, parse_spec
from drafters.merge import MergedDrafter
from drafters.ngram import NgramDrafter
from drafters.spec import DrafterSpec


@pytest.mark.parametrize("spec, parsed", [
    (None, []), ("none", []), (" NONE ", []),
    ("ngram", [DrafterSpec("ngram")]),
    ("early-exit", [DrafterSpec("early-exit")]),
    ("early-exit:6", [DrafterSpec("early-exit", "6")]),
    ("qwen2.5-coder-0.5b-instruct", [DrafterSpec("model", "qwen2.5-coder-0.5b-instruct")]),
    ("ngram+early-exit:6", [DrafterSpec("ngram"), DrafterSpec("early-exit", "6")]),
    ("early-exit:trained", [DrafterSpec("early-exit-head")]),
    ("early-exit:heads/ee", [DrafterSpec("early-exit-head", "heads/ee")]),
    ("feature", [DrafterSpec("feature")]),
    ("feature:/tmp/head+ngram", [DrafterSpec("feature", "/tmp/head"), DrafterSpec("ngram")]),
])
def test_specs_parse(spec, parsed):
    assert parse_spec(spec) == parsed
    assert "+".join(map(str, parsed)) == ("" if not parsed else spec.strip())


@pytest.mark.parametrize("spec, message", [
    ("ngram+", "empty part"), ("ngram+none", "cannot be combined"), ("ngram:3", "takes no argument"),
    ("early-exit:0", "positive number of layers"),
])
def test_bad_specs_say_what_to_write(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_build():
    assert build_drafter("none") is None
    assert isinstance(build_drafter("ngram"), NgramDrafter)
    assert isinstance(build_drafter("ngram+ngram"), MergedDrafter)
