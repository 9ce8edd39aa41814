"""Engine configuration: one dataclass, validated once, passed to every component."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_KV_CACHE_MEMORY = "1GiB"  # the KV pool on a CPU, unless told
# On a GPU, unless told: the share of its memory that weights, activations and the KV pool take
# together (vLLM's --gpu-memory-utilization default), the pool getting what a profiling forward leaves.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
SPECULATION_MODES = ("adaptive", "fixed", "off")
DRAFT_QUANTIZATIONS = ("int8", "int4")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "int8", "fp8")
CPU_DRAFT_VOCAB = 32768  # draft models' scored tokens on a CPU, for vocabularies over twice this
# The server's limits (`specserve serve`): larger request bodies get 413; more requests in the
# engine (running or waiting) get 503.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_QUEUED_REQUESTS = 256

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 64  # running sequences per step (a decoding sequence costs one token)
    max_num_batched_tokens: int = 512  # tokens per forward: prefill chunks + decode tokens + trees
    # bytes, "2GiB", or a fraction: of available RAM on a CPU, of the whole GPU on one (weights and
    # activations included, as vLLM's --gpu-memory-utilization). None: DEFAULT_KV_CACHE_MEMORY on a
    # CPU, DEFAULT_GPU_MEMORY_UTILIZATION on a GPU.
    kv_cache_memory: int | float | str | None = None
    enable_prefix_caching: bool = True
    # How much room admission keeps for the running sequences' growth (`specserve.admission`,
    # SGLang's flag): 1 the default, higher fewer preemptions, 0 admits on the first prompt
    # chunk alone (vLLM's way) and leaves the rest to preemption.
    schedule_conservativeness: float = 1.0
    max_model_len: int | None = None  # default: the model's context, capped by the KV pool
    draft: str = "none"  # drafter spec (see `drafters.spec`): "ngram", "early-exit:6", a model, "a+b", "none"
    max_tree_tokens: int = 8  # drafted nodes per request and step at most
    # Model drafters: children per expanded node, and nodes expanded per draft forward (1 and 1: a
    # chain). None: chains on a CPU, 4 and 4 elsewhere (`draft_shape`).
    draft_top_k: int | None = None
    draft_beam: int | None = None
    # Draft models: score only the first N token ids (N >= the vocabulary: all). None: all, except
    # on a CPU for vocabularies over 65536 tokens, 32768 (`CPU_DRAFT_VOCAB`).
    draft_vocab: int | None = None
    # draft models: "int8" or "int4" projections, "none": as loaded; None: `draft_quantization_for`
    draft_quantization: str | None = None
    # "adaptive": each step's tree budgets maximise expected tokens/s under the measured cost
    # model; "fixed": every speculating request gets its cap; "off": the plain engine.
    speculation: str = "adaptive"
    # The target's weights: "auto" serves a GGUF in its own quantized blocks (else the checkpoint
    # as saved); "none" serves plain weights (a GGUF's dequantized exactly).
    quantization: str = "auto"
    # Where the target, its drafters and the KV pool live: "auto" (CUDA when there is one), "cpu",
    # "cuda" or "cuda:N". bf16 is the default dtype on CUDA.
    device: str = "auto"
    # "auto": the model directory's weights; "dummy": random weights at its config.json's shape
    # (`specserve.models.dummy`), to measure speed where the weights cannot be fetched.
    load_format: str = "auto"
    # The KV pool's element type: "auto" (the model's dtype), "fp32", "bf16", "int8" (codes with a
    # scale byte per 32 channels beside them: about half of bf16's bytes, quantized as written and
    # dequantized inside attention) or "fp8" (e4m3, GPUs with fp8).
    kv_cache_dtype: str = "auto"
    # On CUDA, small steps (decodes and verification trees up to 512 tokens) replay forwards
    # captured at start-up as CUDA graphs (`specserve.cuda_graphs`); True runs every step eagerly.
    enforce_eager: bool = False
    # Ranks the target's weights and KV heads are split over (`specserve.parallel`): worker
    # processes over gloo on a CPU, NCCL on GPUs (rank r on cuda:r). Plain weights only;
    # `kv_cache_memory` is each rank's.
    tensor_parallel_size: int = 1
    # "auto": one rank runs in this process without torch.distributed; "mp": always through the
    # tensor-parallel path (one rank too: a single GPU runs NCCL and the step broadcast as N would)
    distributed_executor: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in every step, or the newest starve.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): raise the token budget or lower max_num_seqs")
        if not self.schedule_conservativeness >= 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and one to generate), "
                             f"got {self.max_model_len}")
        if self.max_tree_tokens < 0:
            raise ValueError(f"max_tree_tokens must be >= 0, got {self.max_tree_tokens}")
        if (self.draft_top_k is not None and self.draft_top_k < 1) or (self.draft_beam is not None
                                                                     and self.draft_beam < 1):
            raise ValueError(f"draft_top_k and draft_beam must be >= 1, got {self.draft_top_k} and {self.draft_beam}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1 (or None for the whole vocabulary), got {self.draft_vocab}")
        if self.draft_quantization not in (None, "none", *DRAFT_QUANTIZATIONS):
            raise ValueError(f"draft_quantization {self.draft_quantization!r}: use "
                             f"{', '.join(DRAFT_QUANTIZATIONS)} or none")
        from specserve.models.loader import QUANTIZATIONS

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
        from specserve.models.loader import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
        self.torch_device  # validate early  # noqa: B018
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation {self.speculation!r}: use one of {', '.join(SPECULATION_MODES)}")
        from drafters.spec import parse_spec

        parse_spec(self.draft)  # a bad spec fails here, before any model loads
        self.kv_cache_bytes  # validate early  # noqa: B018
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_executor not in ("auto", "mp"):
            raise ValueError(f"distributed_executor {self.distributed_executor!r}: use auto or mp")
        if self.splits_target and self.quantization in ("int8", "int4"):
            raise ValueError(f"quantization {self.quantization} runs unsplit CPU kernels: with tensor "
                             "parallelism use auto or none (plain weights)")
        if self.kv_cache_dtype == "fp8" and self.torch_device.type != "cuda":
            raise ValueError("kv_cache_dtype fp8 needs a GPU with fp8 (compute capability 8.9 or newer): "
                             "on a CPU use --kv-cache-dtype int8 (the same bytes per token)")

    @property
    def splits_target(self) -> bool:
        """Whether the target runs through the tensor-parallel path (`specserve.parallel`)."""
        return self.tensor_parallel_size > 1 or self.distributed_executor == "mp"

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element type for a model computing in `model_dtype`."""
        import torch

        named = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
        return named.get(self.kv_cache_dtype, model_dtype)

    def default_draft_vocab(self, device: torch.device) -> int | None:
        """What a large-vocabulary draft model scores when `draft_vocab` is not set (FR-Spec). On
        a CPU the LM head is a large share of a draft forward (Qwen2.5-Coder-0.5B's, 152k tokens:
        a third of its bytes), and with the first 32k tokens the 0.5B draft's chains sped coding
        replies up 1.19x over plain decoding where the whole vocabulary gave 1.14x
        (benchmarks/draft_shapes.py, AMD EPYC, 2 threads)."""
        return CPU_DRAFT_VOCAB if device.type == "cpu" else None

    def draft_quantization_for(self, device: torch.device) -> str | None:
        """How draft models' projections are quantized on `device` (None: as loaded). Unset, int4
        on a CPU, where a draft forward is bound by the bytes it reads: the 0.5B draft's chains
        sped coding replies up 1.30x over plain decoding where its GGUF's own 5- to 8-bit blocks
        gave 1.23x (benchmarks/draft_shapes.py, AMD EPYC, 2 threads). The target verifies every
        token, so a draft's quantization changes no output."""
        if self.draft_quantization is None:
            return "int4" if device.type == "cpu" else None
        return None if self.draft_quantization == "none" else self.draft_quantization

    def draft_shape(self, device: torch.device) -> tuple[int, int]:
        """(top_k, beam) of model drafters on `device`, the unset ones by default. On a CPU every
        verified row costs (Qwen2.5-Coder-1.5B: three rows 1.2x one) and a draft forward of
        several rows too, so chains, whose nodes are each the likeliest guess, beat trees whose
        siblings are rarely accepted: with the 0.5B draft, adaptive chains gave 1.14x plain
        decoding where adaptive 4-wide trees gave 0.99x (benchmarks/draft_shapes.py, AMD EPYC,
        2 threads). On a GPU rows are nearly free up to tens of them, and trees win."""
        wide = 1 if device.type == "cpu" else 4
        return (wide if self.draft_top_k is None else self.draft_top_k,
                wide if self.draft_beam is None else self.draft_beam)

    @property
    def torch_device(self) -> torch.device:
        """`device` resolved: auto is CUDA where torch sees a GPU, else the CPU."""
        import torch

        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: torch sees no CUDA GPU here; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: there are {torch.cuda.device_count()} CUDA GPUs")
        return device

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size in bytes on a CPU."""
        return parse_memory(DEFAULT_KV_CACHE_MEMORY if self.kv_cache_memory is None else self.kv_cache_memory)

    @property
    def gpu_memory_fraction(self) -> float | None:
        """On a GPU, the share of its memory the engine may fill (the pool sized after a profiling
        forward, `gpu_kv_budget`); None where `kv_cache_memory` gives the pool's bytes."""
        if self.kv_cache_memory is None:
            return DEFAULT_GPU_MEMORY_UTILIZATION
        return memory_fraction(self.kv_cache_memory)


def parse_memory(value: int | float | str) -> int:
    """Bytes from `123456`, `"512MiB"`, `"2GB"`, or a fraction of available RAM such as `0.25`."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"kv cache memory {value!r}: give bytes (e.g. 2GiB, 512MB, 1000000) or a fraction "
                             "of available memory (e.g. 0.3)")
        number, unit = float(match.group(1)), match.group(2).lower()
        value = number if unit == "" and number <= 1 and "." in match.group(1) else int(number * _UNITS[unit])
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"kv cache memory fraction must be in (0, 1], got {value}")
        return int(value * available_memory())
    if value <= 0:
        raise ValueError(f"kv cache memory must be positive, got {value} bytes")
    return int(value)


def memory_fraction(value: int | float | str) -> float | None:
    """The fraction `value` names (0.3, "0.3"), or None for a size in bytes ("2GiB", 123456)."""
    if isinstance(value, float):
        return value
    if isinstance(value, str) and (match := re.fullmatch(r"\s*([0-9]*\.[0-9]+)\s*", value)):
        number = float(match.group(1))
        return number if number <= 1 else None
    return None


def gpu_kv_budget(total: int, in_use: int, fraction: float) -> int:
    """Bytes the KV pool may take on a GPU of `total` bytes where the engine may fill `fraction` of
    it and already takes `in_use` (weights, drafters, a profiling forward's activations)."""
    budget = int(fraction * total) - in_use
    if budget <= 0:
        raise ValueError(f"the model takes {in_use / 2**30:.1f} GiB of the {fraction:.0%} of this GPU's "
                         f"{total / 2**30:.1f} GiB that --kv-cache-memory allows: raise it (e.g. 0.95), or give "
                         f"the pool's size in bytes")
    return budget


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def load_config_file(path: str | Path) -> dict:
    """A YAML config (`configs/*.yaml`): `target`, `dtype` and any `EngineConfig` field, with
    `draft` a drafter spec string. Unknown keys are an error naming the known ones."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file is a mapping of settings (target: ..., draft: ...)")
    known = {"target", "dtype"} | {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; known: {', '.join(sorted(known))}")
    engine = {k: v for k, v in data.items() if k not in ("target", "dtype")}
    EngineConfig(**engine)  # validate now, with the file's name in any error
    return data
