"""`specserve generate` on the real SmolLM2: output, flags, errors, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specserve.detokenizer import load_tokenizer

PROMPT = "Name three rivers in Europe."


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )


@pytest.mark.slow
def test_cli_greedy_output_equals_transformers_generate(smollm2_path):
    from specserve.models.loader import load_transformers

    result = run_cli("generate", PROMPT, "--json", "--max-tokens", "24", "--dtype", "float32", "--quantization", "none")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tokenizer = load_tokenizer(smollm2_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    assert out["prompt_tokens"] == len(prompt_ids)
    hf = load_transformers(smollm2_path, torch.float32)
    theirs = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids):]
    assert out["token_ids"] == theirs.tolist()


@pytest.mark.slow
def test_cli_speculates_from_a_config_file_without_changing_the_output(smollm2_path):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "smollm2-early-exit.yaml"
    plain = run_cli("generate", PROMPT, "--json", "--max-tokens", "24", "--dtype", "float32")
    spec = run_cli("generate", PROMPT, "--json", "--max-tokens", "24", "--dtype", "float32", "--config", str(config),
                   "--speculation", "fixed")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


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
def test_cli_seeded_sampling_is_reproducible(smollm2_path):
    args = ("generate", "Write a haiku about the sea.", "--json", "--max-tokens", "12", "--temperature", "1.0",
            "--seed", "7")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.slow
def test_cli_stop_string_ends_the_text(smollm2_path):
    result = run_cli("generate", "Count from 1 to 20, separated by commas.", "--json", "--max-tokens", "64",
                     "--stop", "5", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "stop" and "5" not in out["text"] and "4" in out["text"]


def test_unknown_target_lists_known_models():
    result = run_cli("generate", "hi", "--target", "no-such-model")
    assert result.returncode == 2
    assert "unknown model 'no-such-model'" in result.stderr and "smollm2-135m-instruct" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--draft", "ngram+"], "has an empty part"),
    (["--draft", "early-exit:x"], "give a positive number of layers"),
    (["--kv-cache-memory", "lots"], "give bytes (e.g. 2GiB"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
])
def test_bad_flags_get_clear_errors(args, message):
    result = run_cli("generate", "hi", *args)
    assert result.returncode == 2 and message in result.stderr


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
