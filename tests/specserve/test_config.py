"""Engine configuration: memory budgets and budgets that would starve sequences are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafters.spec import parse_spec
from specserve.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    available_memory,
    gpu_kv_budget,
    load_config_file,
    parse_memory,
)


@pytest.mark.parametrize("value, expected", [
    (1000, 1000), ("1000", 1000), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("64mib", 64 * 2**20),
])
def test_memory_in_bytes(value, expected):
    assert parse_memory(value) == expected


def test_memory_as_a_fraction_of_available():
    assert abs(parse_memory(0.5) - available_memory() / 2) < available_memory() * 0.05
    assert parse_memory("0.25") > 0


@pytest.mark.parametrize("value, message", [
    ("lots", "give bytes"), (0.0, "fraction must be in (0, 1]"), (1.5, "fraction must be in (0, 1]"),
    (-5, "must be positive"), ("3XB", "give bytes"),
])
def test_bad_memory_is_refused_with_a_hint(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_memory(value)


def test_token_budget_must_cover_every_running_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be at least max_num_seqs"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=16)


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_file_is_valid(path):
    settings = load_config_file(path)
    assert settings["target"] and parse_spec(settings.get("draft"))


def test_config_files_refuse_unknown_settings(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: smollm2-135m-instruct\ndraft_model: x\n")
    with pytest.raises(ValueError, match=r"unknown settings \['draft_model'\]; known: .*draft"):
        load_config_file(path)
    path.write_text("draft: ngram+\n")
    with pytest.raises(ValueError, match="empty part"):
        load_config_file(path)
    path.write_text("draft_vocab: 0\n")
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        load_config_file(path)
    path.write_text("draft_quantization: int2\n")
    with pytest.raises(ValueError, match="draft_quantization 'int2': use int8, int4 or none"):
        load_config_file(path)
    path.write_text("schedule_conservativeness: -1\n")
    with pytest.raises(ValueError, match="schedule_conservativeness must be >= 0"):
        load_config_file(path)
    path.write_text("speculation: sometimes\n")
    with pytest.raises(ValueError, match="use one of adaptive, fixed, off"):
        load_config_file(path)


def test_flags_override_the_config_file(tmp_path):
    from specserve.cli import build_parser, engine_settings

    path = tmp_path / "c.yaml"
    path.write_text("target: smollm2-135m-instruct\ndraft: ngram\nmax_tree_tokens: 4\n")
    args = build_parser().parse_args(["generate", "hi", "--config", str(path), "--draft", "early-exit:6"])
    assert engine_settings(args) == {"target": "smollm2-135m-instruct", "draft": "early-exit:6", "max_tree_tokens": 4}
    args = build_parser().parse_args(["generate", "hi", "--config", str(path), "--draft-vocab", "32768"])
    assert engine_settings(args)["draft_vocab"] == 32768
    args = build_parser().parse_args(["generate", "hi", "--draft-quantization", "int8"])
    assert engine_settings(args)["draft_quantization"] == "int8"
    args = build_parser().parse_args(["serve", "--enforce-eager"])
    assert engine_settings(args)["enforce_eager"] is True
    args = build_parser().parse_args(["serve", "--schedule-conservativeness", "0"])
    assert engine_settings(args)["schedule_conservativeness"] == 0.0
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_settings(args) == {"target": "smollm2-135m-instruct"}


def test_model_drafters_draft_chains_on_a_cpu_and_trees_elsewhere_unless_told():
    import torch

    assert EngineConfig().draft_shape(torch.device("cpu")) == (1, 1)
    assert EngineConfig().draft_shape(torch.device("cuda")) == (4, 4)
    assert EngineConfig(draft_top_k=3, draft_beam=2).draft_shape(torch.device("cpu")) == (3, 2)


def test_draft_models_read_int4_blocks_on_a_cpu_unless_told():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().draft_quantization_for(cpu) == "int4"
    assert EngineConfig().draft_quantization_for(cuda) is None
    assert EngineConfig(draft_quantization="none").draft_quantization_for(cpu) is None
    assert EngineConfig(draft_quantization="int8").draft_quantization_for(cpu) == "int8"


def test_large_vocabulary_drafts_score_their_frequent_tokens_on_a_cpu_only():
    import torch

    assert EngineConfig().default_draft_vocab(torch.device("cpu")) == 32768
    assert EngineConfig().default_draft_vocab(torch.device("cuda")) is None


def test_the_kv_pool_is_a_size_on_a_cpu_and_a_share_of_the_whole_gpu_on_one():
    unset = EngineConfig()
    assert unset.kv_cache_bytes == 2**30 and unset.gpu_memory_fraction == DEFAULT_GPU_MEMORY_UTILIZATION
    assert EngineConfig(kv_cache_memory="0.8").gpu_memory_fraction == 0.8
    assert EngineConfig(kv_cache_memory=0.5).gpu_memory_fraction == 0.5
    assert EngineConfig(kv_cache_memory="2GiB").gpu_memory_fraction is None  # bytes are bytes everywhere
    # 80 GiB, 90% of it allowed, 20 GiB taken by weights and a profiling forward: 52 GiB for K/V
    assert gpu_kv_budget(80 * 2**30, 20 * 2**30, 0.9) == 52 * 2**30
    with pytest.raises(ValueError, match="raise it"):
        gpu_kv_budget(16 * 2**30, 15 * 2**30, 0.9)
