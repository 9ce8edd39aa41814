"""What serving needs of a model short of its weights: the tokenizer and the request limits.

The engine has one; so does a Ray Serve ingress (`specserve.replicas`), which tokenizes and checks
requests before any replica sees them and holds no weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.sampling import SamplingParams


@dataclass(frozen=True)
class Limits:
    """A served model's sizes that decide whether a request can ever be served."""

    vocab_size: int
    max_model_len: int  # prompt + output tokens per request at most
    model_context: int  # the model's own context
    num_kv_tokens: int  # the KV pool's tokens


class Frontend:
    def __init__(self, tokenizer: Any, limits: Limits):
        self.tokenizer, self.limits = tokenizer, limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt; with `chat`, wrap it as one user turn in the model's chat template."""
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template: send a plain prompt instead of messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError, saying what to change, for a request that could never be served."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.limits.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len} (model context {self.limits.model_context}, "
                f"KV pool {self.limits.num_kv_tokens} tokens): shorten the prompt, lower max_tokens or raise "
                f"--kv-cache-memory")
