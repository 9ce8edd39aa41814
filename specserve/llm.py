"""The offline API, shaped like vLLM's: `LLM(target=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from itertools import count

import torch

from specserve.config import EngineConfig
from specserve.engine import LLMEngine, Prompt
from specserve.outputs import RequestOutput
from specserve.registry import DEFAULT_TARGET
from specserve.sampling import SamplingParams

Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        draft: str | None = None,
        dtype: str | torch.dtype | None = None,
        **engine_options,
    ):
        """`target`: a known model name, an HF directory or a .gguf file. `draft`: a drafter spec
        (`ngram`, `early-exit:K`, a draft model, `a+b`, `none`; see `drafters.spec`).
        `engine_options` are `EngineConfig` fields (speculation, max_tree_tokens, draft_top_k,
        draft_beam, block_size, max_num_seqs, max_num_batched_tokens, kv_cache_memory, ...).
        A YAML file from `configs/` fits as is: `LLM(**load_config_file(path))`."""
        from specserve.pull import resolve_model

        config = EngineConfig(**engine_options, **({} if draft is None else {"draft": draft}))
        self.engine = LLMEngine(resolve_model(target), dtype=dtype, config=config)
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Like `generate`, for conversations (lists of {"role", "content"}) in the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.engine.encode_chat(list(c)) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One request, yielding its output after every step that advanced it (deltas included)."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def _run(self, prompts: list[Prompt], params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts: give one, or one each")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                self.engine.add_request(request_id, prompt, p)
            return self._drain(ids, use_tqdm)
        finally:  # an error or Ctrl-C leaves nothing behind in the engine
            for request_id in ids:
                self.engine.abort(request_id)

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"requests {sorted(wanted - set(done))} left the engine unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update()
        return [done[i] for i in ids]
