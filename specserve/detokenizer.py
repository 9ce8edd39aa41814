"""From token ids to streamed text: UTF-8-safe incremental decoding and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.models.config import ModelConfig


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# A dummy model's chat turns, where its directory brings no template of its own
SYNTHETIC_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                           "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def load_tokenizer(path: str | Path, config: ModelConfig | None = None):
    """The directory's tokenizer; with `config` (a dummy model's), a synthetic byte-level one of
    the config's vocabulary where the directory has none (`synthetic_tokenizer`)."""
    from transformers import AutoTokenizer

    if config is not None and not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        return synthetic_tokenizer(config)
    return AutoTokenizer.from_pretrained(str(path))


def synthetic_tokenizer(config: ModelConfig):
    """A tokenizer for random weights without a real one (e.g. `configs/models/llama-2-7b`): text
    as UTF-8 bytes, one token each, the config's BOS and EOS ids as `<s>` and `</s>`, and every
    other id decoding to `<tok_ID>`, so whatever a dummy model emits streams as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # the characters ByteLevel shows bytes as

    eos = list(config.eos_token_ids)
    special = {i: "<s>" for i in [config.bos_token_id] if i is not None}
    special |= {i: "</s>" if n == 0 else f"</s{n}>" for n, i in enumerate(eos)}
    free = [i for i in range(config.vocab_size) if i not in special]
    if len(free) < 256:
        raise ValueError(f"a synthetic tokenizer needs 256 ids for bytes: vocab_size {config.vocab_size} is too small")
    vocab = {char: free[byte] for byte, char in bytes_to_unicode().items()}
    vocab |= {f"<tok_{i}>": i for i in free[256:]}
    vocab |= {name: i for i, name in special.items()}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(list(special.values()))
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token=special.get(config.bos_token_id),
                                   eos_token="</s>" if eos else None, chat_template=SYNTHETIC_CHAT_TEMPLATE)


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """The tokenizer's `decode` without special tokens. A fast tokenizer that cleans up no spaces
    is asked directly for what transformers' `decode` returns from it: that wrapper's dozen Python
    calls per call, twice per token, cost a busy step more than the decoding itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a token stream into text deltas, holding back incomplete UTF-8 characters.

    Decodes a short window (a few tokens of context + the unread tokens) so the cost per
    token stays constant, and emits only once the window no longer ends mid-character.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: Sequence[int] | None = None):
        self.decode = text_decoder(tokenizer)
        self.ids = list((prompt_ids or [])[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.decode(self.ids[self.prefix_offset :])
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
