"""A separate small draft model sharing the target's tokenizer (e.g. Qwen2.5-Coder-0.5B for 1.5B).

Its K/V live in its own tensors, indexed by the *same* block tables as the target's, so one
block manager accounts for both (the engine sizes the pool by their summed bytes per block).
The draft keeps, per sequence, how many leading tokens have draft K/V; each step's first
round runs the tokens it has not seen (the accepted run and the bonus token of the last step,
or a whole prompt) as one chain ending at the root, then grows the tree from there. A chain
grows by its newest node alone, the K/V of the rest being in place, and the nodes the target
accepts keep theirs: the next step runs only the last drafted node and the bonus token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.base import DraftTarget, OwnsKV
from drafters.tree_search import TreeSearchDrafter, _Search
from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.config import ModelConfig
from specserve.models.llama import LlamaForCausalLM
from specserve.tree import TokenTree


class DraftModelDrafter(TreeSearchDrafter, OwnsKV):
    def __init__(self, model: LlamaForCausalLM, spec: str, top_k: int = 4, beam: int = 4):
        super().__init__(top_k, beam)
        self.model, self.spec = model, spec
        self.runner: ModelRunner | None = None
        self._computed: dict[int, int] = {}  # seq_id -> leading tokens whose draft K/V are in place
        # seq_id -> the chain nodes whose K/V the last drafting rounds wrote after those tokens,
        # in order: those the sequence now holds at their positions need no second forward
        self._ahead: dict[int, list[int]] = {}

    @classmethod
    def load(cls, name_or_path: str, dtype: str | torch.dtype | None, top_k: int = 4, beam: int = 4,
             vocab: int | None = None, quantization: str | None = None,
             default_vocab: int | None = None, device: torch.device | str = "cpu",
             load_format: str = "auto") -> DraftModelDrafter:
        """A known model name (pulled on first use), an HF directory or a .gguf file. `vocab`:
        score only the first `vocab` token ids and the model's special tokens (see below); None:
        `default_vocab` where the model has more than twice that many, else all.
        `quantization="int8"`: int8 projections for draft forwards (half the bytes to read on a
        CPU, where they are bandwidth-bound; the target verifies every token either way).
        `"int4"`: every projection requantized into 4-bit blocks for our CPU kernel (a GGUF's
        Q5_0/Q6_K/Q8_0 included: fewer bytes and less unpacking a draft forward)."""
        from specserve.models.loader import load_model
        from specserve.pull import resolve_model

        if quantization not in (None, "int8", "int4"):
            raise ValueError(f"draft quantization {quantization!r}: use int8, int4 or none")
        path: Path = resolve_model(name_or_path)
        # int4 blocks compute in fp32 whatever the target's dtype (the draft's K/V are its own)
        model = (load_model(path, None, "int4", load_format, device) if quantization == "int4"
                 else load_model(path, dtype, "auto", load_format, device))
        if vocab is None and default_vocab is not None and model.config.vocab_size > 2 * default_vocab:
            vocab = default_vocab
        if vocab is not None and vocab < model.config.vocab_size:
            model.restrict_output_vocab(frequent_tokens(model, vocab))
        if quantization == "int8":
            model.quantize_int8()
        return cls(model, name_or_path, top_k, beam)

    def kv_bytes_per_block(self, block_size: int, target: ModelConfig | None = None,
                           dtype: torch.dtype | None = None) -> int:
        return KVCache.bytes_per_block(self.model.config, block_size, self.model.dtype)

    def attach(self, target: DraftTarget) -> None:
        if self.model.config.vocab_size > target.vocab_size + 1024:  # padded vocabularies differ a little
            raise ValueError(f"draft model {self.spec!r} has a vocabulary of {self.model.config.vocab_size} tokens, "
                             f"the target {target.vocab_size}: a draft model must share the target's tokenizer")
        cache = KVCache.for_model(self.model.config, target.num_blocks, target.block_size, self.model.dtype,
                                  self.model.norm.weight.device)
        self.runner = ModelRunner(self.model, cache)
        self.vocab_size = target.vocab_size

    def release(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)
        self._ahead.pop(seq_id, None)

    def _tree_request(self, search: _Search) -> TreeRequest:
        request = search.request
        limit = self.model.config.vocab_size - 1  # target-only special tokens: any id will do for a draft
        if search.rounds:
            tree = super()._tree_request(search)
            tokens = tree.tree.tokens
            if tree.tree.is_chain and tuple(tree.logits) == (len(tokens) - 1,):
                # Each earlier round ran one node of the chain, leaving its K/V at its slot
                # (node i at context + i): the newest node alone, attending to them as context.
                position = tree.context_len + len(tokens) - 1
                ahead = self._ahead.setdefault(request.seq_id, [])
                if position == self._computed.get(request.seq_id, 0) + len(ahead):
                    ahead.append(tokens[-1])
                return TreeRequest(TokenTree.chain([tokens[-1]]), position, request.block_table, "all")
            if tokens[0] > limit:
                tree.tree = TokenTree((limit, *tokens[1:]), tree.tree.parents)
            return tree
        total = len(request.token_ids)
        done = self._computed.get(request.seq_id, 0)
        done = done if done < total else 0  # cannot happen unless state went stale: recompute
        # K/V at a position depend only on the tokens up to it: nodes run ahead that the sequence
        # now holds at their positions are in place (the root always runs: its logits are wanted)
        for token in self._ahead.pop(request.seq_id, []) if done else ():
            if done >= total - 1 or request.token_ids[done] != token:
                break
            done += 1
        self._computed[request.seq_id] = total
        return search.catch_up(done, "last", limit)

    def _forward(self, searches: list[_Search]) -> list[torch.Tensor]:
        return [o.logits for o in self.runner.forward([self._tree_request(s) for s in searches])]


def frequent_tokens(model: LlamaForCausalLM, count: int) -> torch.Tensor:
    """About the `count` most frequent tokens, and the BOS/EOS tokens, in all a multiple of 16
    (the rows of the CPU kernel's tiles: a head of 32770 rows ran the untiled kernel at half
    its speed). A byte-level BPE numbers its tokens in merge order, and merges go to the most
    frequent pairs first, so low ids are the frequent tokens (Qwen2.5's first 32k ids hold ~93%
    of the tokens of Python code, its first 64k ~98%). A draft that cannot propose a rare token
    only loses that proposal: verification stays exact."""
    config = model.config
    special = torch.tensor(sorted({t for t in (config.bos_token_id, *config.eos_token_ids)
                                   if t is not None and t < config.vocab_size}), dtype=torch.int64)
    plain = torch.arange(min(count, config.vocab_size))
    plain = plain[~torch.isin(plain, special)]
    surplus = (len(plain) + len(special)) % 16
    if surplus and len(plain) > surplus:
        plain = plain[:-surplus]
    return torch.cat([plain, special])
