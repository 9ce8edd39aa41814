"""The OpenAI-compatible wire format: request bodies (validated by pydantic), their sampling
parameters, and the response and stream-chunk bodies built from engine outputs.

Extensions beyond OpenAI's fields, named as vLLM names them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, and `speculation` ({"enabled", "drafter",
"max_tree_tokens", "tree", "top_k", "max_depth", "share_output"}, see `specserve.sampling.SpeculationParams`);
`usage` carries speculation counts (target forwards that verified a tree, drafted and accepted tokens).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from specserve.outputs import RequestOutput
from specserve.sampling import (
    MAX_DRAFTER_SPEC_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    SamplingParams,
)
from specserve.sequence import SpecStats, TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to what the context leaves
MAX_PROMPTS = 64  # prompts in one completions request (each is a request in the engine)


def valid_unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"contains a lone UTF-16 surrogate {text[error.start]!r} at character {error.start}: "
                         f"send valid Unicode (surrogates come in pairs)") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]


class SpeculationField(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    drafter: Annotated[str, Field(max_length=MAX_DRAFTER_SPEC_CHARS), AfterValidator(valid_unicode)] | None = None
    max_tree_tokens: int | None = Field(default=None, ge=0)
    tree: Literal["chain", "tree", "dynamic"] | None = None
    top_k: int | None = Field(default=None, ge=1)
    max_depth: int | None = Field(default=None, ge=1)
    share_output: bool = True


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we have no use for

    model: str
    n: int = Field(default=1, ge=1, le=16)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    speculation: SpeculationField | None = None

    @field_validator("stop")
    @classmethod
    def _stops_are_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and (stop == "" or (isinstance(stop, list) and any(s == "" for s in stop))):
            raise ValueError("stop strings must not be empty")
        return stop

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            speculation=None if self.speculation is None else self.speculation.model_dump(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: (Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | list[int]
             | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string or a list of token ids each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt is empty: give a string, a list of strings, or token ids")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: OpenAI's list-of-parts form keeps its text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content parts of type {part.get('type')!r} are not supported: "
                                 f"send text parts only")
            parts.append(valid_unicode(str(part.get("text", ""))))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage, plus what speculation did for these requests."""
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    spec = SpecStats()
    for out in outputs:
        spec.add(out.metrics.spec)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculation": {"target_forwards": spec.target_forwards, "verify_forwards": spec.verify_steps,
                        "drafted_tokens": spec.drafted_tokens, "accepted_tokens": spec.accepted_tokens},
    }


def completion_logprobs(entries: list[TokenLogprob], decode, text_offset: int) -> dict:
    """The completions API's logprobs object for generated tokens (`decode`: token id -> text)."""
    tokens, offsets, offset = [], [], text_offset
    for entry in entries:
        piece = decode(entry.token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{decode(t): lp for t, lp in e.top_logprobs.items()} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], decode, top: int) -> dict:
    """The chat API's logprobs object: per token its text, bytes, logprob and top alternatives."""

    def item(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**item(e.token_id, e.logprob),
         "top_logprobs": [item(t, lp) for t, lp in list(e.top_logprobs.items())[:top]]}
        for e in entries
    ]}

