"""Our C++ CPU kernels, built for this machine on first use.

* `block_matmul(x, codes, scale, min, bits, group)`: `x @ W.T` with `W = scale * codes + min` per
  group of `group` inputs, GGUF's quantized blocks as stored (`kernels/cpu/block_matmul.cpp`).
* `tiled_matmul(x, codes, scale, min, bits)`: the same over weights repacked in tiles of 16
  outputs (`BlockWeight.tiles`), the AVX-512 layout for steps of several rows.
* `kquant_matmul(x, codes, high, sub_scale, sub_min, d, dmin, bits)`: the same for Q4_K and Q6_K
  super-blocks in their own layout (`kernels/cpu/kquant_matmul.cpp`); `kquant_tiled_matmul`, the
  same over super-blocks repacked in tiles of 16 outputs (`SuperBlockWeight.tiles`).
* `tree_attention(...)`: attention over the paged cache (fp32 or bf16, fp32 arithmetic), each
  query row over exactly its visible keys (`kernels/cpu/tree_attention.cpp`).
* `rms_norm(x, weight, eps)`: fp32 RMSNorm in one pass (`kernels/cpu/rms_norm.cpp`); `add_rms_norm`,
  the residual add before it in the same pass.
* `rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads)`: rotary q and k
  out of the fused projection, k and v written to their cache slots (`kernels/cpu/rope_kv.cpp`).
* `silu_mul(gate_up)`: SwiGLU's `silu(gate) * up` in one pass over the fused gate/up output, the
  same bits as torch's (`kernels/cpu/activation.cpp`).
* `DecoderStack` (a class): a model's decoder layers in one call over weights bound once, the
  very ops above in `DecoderLayer`'s order (`kernels/cpu/decoder_stack.cpp`).
* `row_argmax`, `filter_stats`, `sample_rows`: sampling's passes over rows of logits, argmax,
  filtered distributions without a sort, inverse-CDF draws (`kernels/cpu/sampling_rows.cpp`;
  `specserve.sampling` calls them).
* `suffix_match`: the suffix drafter's search, the longest suffix of a query that occurs in a
  corpus of token ids and every place after it (`kernels/cpu/suffix_match.cpp`; `drafters.suffix`
  calls it).

All compute each row as if it were alone in the step. They are compiled once per CPU
(`-march=native`: AVX-512 VNNI, AVX2 or portable C++) and cached under the specserve cache
directory; later starts only load them. `SPECSERVE_CPU_MARCH=haswell` (any gcc `-march`) builds
for another instruction set instead: how the tests check the AVX2 and portable paths on a CPU
that would pick AVX-512.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("block_matmul.cpp", "kquant_matmul.cpp", "tree_attention.cpp", "rms_norm.cpp", "rope_kv.cpp",
                        "sampling_rows.cpp", "activation.cpp", "decoder_stack.cpp", "suffix_match.cpp")]
HEADERS = [SOURCES[0].parent / name for name in ("fixed_order.h", "int8_rows.h", "kv_int8.h", "scratch.h", "silu.h")]
log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be built here; the message says what is missing."""


def _march() -> str:
    return os.environ.get("SPECSERVE_CPU_MARCH", "native")


def _cflags() -> list[str]:
    # No contraction into fused multiply-adds: the kernels say where they fuse (rope_kv.cpp must
    # round like torch's separate products and sums).
    return ["-O3", f"-march={_march()}", "-fopenmp", "-ffp-contract=off"]


@cache
def build_key() -> str:
    """What the compiled code depends on: the CPU's instruction sets, the flags, the source, torch."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    digest = hashlib.sha256()
    sources = [*SOURCES, *HEADERS]
    for part in (flags, *_cflags(), *(s.read_text() for s in sources), torch.__version__, sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build_root() -> Path:
    """Where compiled kernels are kept: beside the models and cost curves."""
    from specserve.pull import cache_dir

    return cache_dir() / "kernels"


def library_path() -> Path:
    """The kernels' library built for this CPU: `load` compiles it there once."""
    return build_root() / f"cpu-{build_key()}" / "specserve_cpu.so"


def compile_library(name: str, sources: list[Path], build_directory: Path) -> None:
    """Compile `sources` (once; ninja rebuilds what changed) into a library that registers its ops
    with torch, with the kernels' own flags."""
    from torch.utils import cpp_extension

    build_directory.mkdir(parents=True, exist_ok=True)
    # pip puts ninja beside the interpreter; a server started as .venv/bin/specserve lacks it on PATH
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cpp_extension.load(
        name=name, sources=[str(s) for s in sources], extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
        build_directory=str(build_directory), is_python_module=False,
        verbose=os.environ.get("SPECSERVE_VERBOSE_BUILD") == "1",
    )


@cache
def load() -> None:
    """Build (once per CPU) and load the kernels, registering `torch.ops.specserve_cpu`."""
    start = time.perf_counter()
    try:
        library = library_path()
        compile_library(library.stem, SOURCES, library.parent)
    except (RuntimeError, OSError, ImportError) as e:
        raise KernelBuildError(
            f"could not build specserve's CPU kernels ({e}). It needs a C++ compiler (g++) and ninja "
            f"(`pip install ninja`); or serve unquantized weights with --quantization none"
        ) from e
    log.info("CPU kernels ready (%s) in %.1f s", torch.ops.specserve_cpu.isa(), time.perf_counter() - start)


def isa() -> str:
    """The instruction path the loaded kernel was compiled for: avx512-vnni (+amx where the CPU and Linux
    allow AMX tiles: steps of 11 rows and more), avx2+vnni, avx2 or portable."""
    load()
    return torch.ops.specserve_cpu.isa()


def op(name: str) -> torch._ops.OpOverload:
    """Our kernel `name` itself (no Python wrapper around each call: a layer of a small model makes
    over a hundred of them a step)."""
    load()
    return getattr(torch.ops.specserve_cpu, name).default


def block_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.block_matmul(x, codes, scale, min, bits, group)


def tiled_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor,
                 bits: int) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.tiled_matmul(x, codes, scale, min, bits)


def tiled_swiglu(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """`silu_mul(tiled_matmul(x, ...))` in one op, the same bits (tiles: gate's, then as many of up's)."""
    load()
    return torch.ops.specserve_cpu.tiled_swiglu(x, codes, scale, min, bits)


def kquant_matmul(
    x: torch.Tensor, codes: torch.Tensor, high: torch.Tensor, sub_scale: torch.Tensor, sub_min: torch.Tensor,
    d: torch.Tensor, dmin: torch.Tensor, bits: int,
) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.kquant_matmul(x, codes, high, sub_scale, sub_min, d, dmin, bits)


def kquant_tiled_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor,
                        dmin: torch.Tensor, bits: int) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.kquant_tiled_matmul(x, codes, scales, d, dmin, bits)


def tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, ancestor_mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.tree_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables,
                                                  ancestor_mask, scale)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` for `gate, up = gate_up.chunk(2, -1)` (fp32 on the CPU), in one pass."""
    load()
    return torch.ops.specserve_cpu.silu_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    load()
    return torch.ops.specserve_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, rms_norm(x + delta))` in one pass: a layer's residual add and the next norm."""
    load()
    return torch.ops.specserve_cpu.add_rms_norm(x, delta, weight, eps)


def rope_write_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """The step's queries `[T, heads, head_dim]`, rotated; its keys (rotated) and values written to the cache."""
    load()
    return torch.ops.specserve_cpu.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                 num_kv_heads)


def decoder_stack(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  eps: float) -> torch.ScriptObject:
    """An empty `DecoderStack` for a model of this shape (weights bound with its methods)."""
    load()
    return torch.classes.specserve_cpu.DecoderStack(num_layers, num_heads, num_kv_heads, head_dim, eps)
