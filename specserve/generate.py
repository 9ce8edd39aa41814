"""Offline single-request generation: a simple loop over the model and the paged cache.

The continuous batcher replaces this loop in the engine; it stays the shortest readable
path from a prompt to tokens (prefill chunks and decode steps are both token trees).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.loader import load_model
from specserve.sampling import SamplingParams, SamplingRow, sample
from specserve.tree import TokenTree

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds the attention mask's memory


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class IncrementalDetokenizer:
    """Turns a token stream into text deltas, holding back incomplete UTF-8 characters.

    Decodes a short window (a few tokens of context + the unread tokens) so the cost per
    token stays constant, and emits only once the window no longer ends mid-character.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None):
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


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.elapsed_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0


class Generator:
    """Loads a target model and its tokenizer; generates for one prompt at a time."""

    def __init__(self, model_path: str | Path, dtype: str | torch.dtype | None = None, block_size: int = 16):
        self.model = load_model(model_path, dtype)
        self.tokenizer = load_tokenizer(model_path)
        self.config = self.model.config
        self.block_size = block_size
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Apply the chat template for instruct models unless `raw`; then tokenize."""
        if not raw and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Iterator[tuple[int, str, Generation]]:
        """Yield `(token, text delta, generation so far)` for each generated token."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        total = len(prompt_ids) + max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.config.max_model_len} tokens: shorten the prompt or lower max_tokens"
            )
        num_blocks = -(-total // self.block_size)
        cache = KVCache.for_model(self.config, num_blocks, self.block_size, self.model.dtype)
        runner = ModelRunner(self.model, cache)
        table = list(range(num_blocks))
        rng = torch.Generator().manual_seed(seed) if seed is not None else None
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
        gen = Generation(prompt_ids=list(prompt_ids))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        start = time.perf_counter()

        logits = None
        for pos in range(0, len(prompt_ids), PREFILL_CHUNK):  # prefill: chains, logits of the last node
            chunk = TokenTree.chain(prompt_ids[pos : pos + PREFILL_CHUNK])
            logits = runner.forward([TreeRequest(chunk, pos, table, logits="last")])[0].logits[-1]
        context_len = len(prompt_ids)
        while True:
            token = sample(logits[None], [SamplingRow(params, prompt_ids, gen.token_ids, rng)])[0]
            gen.token_ids.append(token)
            now = time.perf_counter() - start
            gen.ttft_s = gen.ttft_s or now
            gen.elapsed_s = now
            if token in self.eos_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= max_tokens:
                gen.finish_reason = "length"
            delta = "" if token in self.eos_ids else detok.push(token)
            gen.text += delta
            yield token, delta, gen
            if gen.finish_reason:
                return
            step = TreeRequest(TokenTree.single(token), context_len, table, logits="last")
            logits = runner.forward([step])[0].logits[-1]
            context_len += 1

