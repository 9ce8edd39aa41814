"""`specserve generate` and the offline generation loop on the real SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specserve.generate import Generator, IncrementalDetokenizer, load_tokenizer

PROMPT = "Name three rivers in Europe."


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )


@pytest.mark.slow
def test_greedy_generation_equals_transformers_generate(smollm2_path):
    from transformers import AutoModelForCausalLM

    gen = Generator(smollm2_path, dtype="float32")
    prompt_ids = gen.encode(PROMPT)
    ours = [tok for tok, _, _ in gen.stream(prompt_ids, max_tokens=24)]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)
    theirs = out[0, len(prompt_ids):].tolist()
    assert ours == theirs[: len(ours)]
    assert len(ours) == len(theirs)  # both stop at the same EOS (or both hit max_tokens)


@pytest.mark.slow
def test_cli_json_output(smollm2_path):
    result = run_cli("generate", PROMPT, "--json", "--max-tokens", "16", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {"text", "token_ids", "tokens_per_s"} <= set(out)
    assert 0 < len(out["token_ids"]) <= 16 and out["tokens_per_s"] > 0
    tokenizer = load_tokenizer(smollm2_path)
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)


@pytest.mark.slow
def test_cli_streams_text_and_reports_speed(smollm2_path):
    result = run_cli("generate", "Once upon a time", "--raw", "--max-tokens", "12", "--seed", "3",
                     "--temperature", "0.8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(smollm2_path):
    gen = Generator(smollm2_path)
    ids = gen.encode("Write a haiku about the sea.")
    first = [t for t, _, _ in gen.stream(ids, max_tokens=12, temperature=1.0, seed=7)]
    second = [t for t, _, _ in gen.stream(ids, max_tokens=12, temperature=1.0, seed=7)]
    assert first == second


def test_unknown_target_lists_known_models():
    result = run_cli("generate", "hi", "--target", "no-such-model")
    assert result.returncode == 2
    assert "unknown model 'no-such-model'" in result.stderr and "smollm2-135m-instruct" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--draft", "ngram"], "--draft"),
])
def test_bad_flags_get_clear_errors(args, message):
    result = run_cli("generate", "hi", *args)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.slow
def test_detokenizer_streams_multibyte_text_exactly(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    text = "Zürich → 東京 🚀 naïve café, ok!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say:"))
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.slow
def test_bf16_generation_process_stays_under_1_5_gb(smollm2_path):
    """Peak RSS of a whole `specserve generate` process on SmolLM2 in bf16."""
    probe = (
        "import resource, subprocess, sys;"
        "r = subprocess.run([sys.executable, '-m', 'specserve.cli', 'generate', 'Tell me a story.',"
        " '--max-tokens', '32', '--dtype', 'bfloat16'], capture_output=True);"
        "assert r.returncode == 0, r.stderr;"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    peak_mb = int(result.stdout.strip()) / 1024
    print(f"peak RSS of `specserve generate` (SmolLM2, bf16): {peak_mb:.0f} MB")
    assert peak_mb < 1536
