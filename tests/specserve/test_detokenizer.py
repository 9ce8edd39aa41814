"""Streaming text: multi-byte characters are never split, stop strings are found across token
boundaries and never emitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.detokenizer import IncrementalDetokenizer, TextStream, load_tokenizer, text_decoder


class PieceTokenizer:
    """Token i decodes to PIECES[i]; enough of a tokenizer for the text stream."""

    PIECES = ["Hello", " wor", "ld", "!", " ST", "OP", " and", " more", "S", "T", "O", "P", " "]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)

    def ids(self, *pieces: str) -> list[int]:
        return [self.PIECES.index(p) for p in pieces]


def stream(pieces: list[str], stop: list[str]) -> tuple[list[str], bool, TextStream]:
    tok = PieceTokenizer()
    text = TextStream(tok, [], stop)
    deltas, stopped = [], False
    for token in tok.ids(*pieces):
        delta, stopped = text.push(token)
        deltas.append(delta)
        if stopped:
            break
    else:
        deltas.append(text.flush())
    return deltas, stopped, text


def test_without_stop_strings_text_streams_token_by_token():
    deltas, stopped, text = stream(["Hello", " wor", "ld", "!"], [])
    assert deltas[:4] == ["Hello", " wor", "ld", "!"] and not stopped and text.text == "Hello world!"


def test_stop_string_spanning_tokens_is_found_and_not_emitted():
    deltas, stopped, text = stream(["Hello", " ST", "OP", " and"], ["STOP"])
    assert stopped and text.text == "Hello "
    assert "".join(deltas) == "Hello "


def test_stop_string_spread_over_single_letter_tokens():
    deltas, stopped, text = stream(["Hello", " ", "S", "T", "O", "P", " more"], [" STOP"])
    assert stopped and text.text == "Hello"
    assert deltas == ["Hello", "", "", "", "", ""]  # " S", " ST", " STO" were held back: each could start " STOP"


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop_string():
    deltas, stopped, text = stream(["Hello", " ST", " and"], ["STOP"])
    assert not stopped
    assert deltas == ["Hello", " ", "ST and", ""]
    assert text.text == "Hello ST and"


def test_held_back_text_is_flushed_at_the_end():
    deltas, stopped, text = stream(["Hello", " ST"], ["STOP"])
    assert not stopped and deltas[-1] == "ST" and text.text == "Hello ST"


def test_earliest_of_several_stop_strings_wins():
    _, stopped, text = stream(["Hello", " wor", "ld", " ST", "OP"], ["STOP", "world"])
    assert stopped and text.text == "Hello "


@pytest.mark.slow
def test_multibyte_characters_stream_exactly(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    text = "Zürich → 東京 🚀 naïve café, ok!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say:"))
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_stop_string_inside_a_multibyte_run(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    ids = tokenizer.encode("Travel to 東京 and then 🚀 home")
    text = TextStream(tokenizer, [], ["京 and"])
    emitted = ""
    for token in ids:
        delta, stopped = text.push(token)
        emitted += delta
        if stopped:
            break
    assert stopped and emitted == "Travel to 東"


@pytest.mark.slow
def test_the_text_decoder_returns_what_the_tokenizer_decodes(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    decode = text_decoder(tokenizer)
    ids = tokenizer.encode("Zürich → 東京 🚀") + [tokenizer.eos_token_id] + tokenizer.encode(" naïve , ok .")
    windows = [ids[i:j] for i in range(len(ids)) for j in range(i + 1, min(len(ids), i + 6) + 1)]
    assert [decode(w) for w in windows] == [tokenizer.decode(w, skip_special_tokens=True) for w in windows]


def test_a_tokenizer_that_cleans_up_spaces_decodes_its_own_way():
    class Cleaning(PieceTokenizer):
        clean_up_tokenization_spaces = True
        backend_tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "without the clean-up")

    assert text_decoder(Cleaning())(Cleaning().ids("Hello", " wor")) == "Hello wor"
