"""`--load-format dummy`: random weights at a config's real shape, the same on every load, served
end to end (a synthetic tokenizer where the directory has none)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from specserve.config import EngineConfig
from specserve.detokenizer import load_tokenizer, synthetic_tokenizer
from specserve.kv_cache import KVCache
from specserve.model_runner import ModelRunner, TreeRequest
from specserve.models.config import ModelConfig
from specserve.models.dummy import dummy_tensors
from specserve.models.loader import load_model
from specserve.tree import TokenTree

SHIPPED = Path(__file__).parents[3] / "configs" / "models"
TINY = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def config_dir(tmp_path: Path, **overrides) -> Path:
    """A model directory holding nothing but a config.json."""
    directory = tmp_path / "config-only"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return directory


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, KVCache.for_model(model.config, 4, 16, model.dtype))
    return runner.forward([TreeRequest(TokenTree.chain(tokens), 0, [0, 1, 2, 3])]).logits


def parameters(config: ModelConfig) -> int:
    """Weights of a config's shape, counted without making them (meta tensors)."""
    return sum(t.numel() for t in dummy_tensors(config, torch.float32, "meta").values())


@pytest.mark.parametrize(("name", "billions"), [("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-3.1-8b", 8.03),
                                                ("llama-160m", 0.162)])
def test_the_shipped_configs_have_their_models_real_sizes(name, billions):
    assert parameters(ModelConfig.from_dir(SHIPPED / name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_a_config_alone_loads_as_a_model_whose_weights_are_the_same_on_every_load(tmp_path):
    directory = config_dir(tmp_path)
    first, second = (load_model(directory, "float32", load_format="dummy") for _ in range(2))
    tokens = [5, 17, 250, 3]
    assert torch.equal(logits_of(first, tokens), logits_of(second, tokens))
    assert first.weight_format() == "plain float32"
    with pytest.raises(FileNotFoundError):  # without dummy, the missing weights are an error
        load_model(directory, "float32")


@pytest.mark.parametrize("overrides", [{"model_type": "qwen2"}, {"tie_word_embeddings": True},
                                       {"attention_bias": True, "mlp_bias": True}])
def test_every_tensor_the_model_takes_is_made_for_biased_and_tied_shapes(tmp_path, overrides):
    model = load_model(config_dir(tmp_path, **overrides), "float32", load_format="dummy")  # unused ones would fail
    assert torch.isfinite(logits_of(model, [1, 2, 3])).all()


def test_dummy_weights_can_be_requantized_for_the_cpu_kernels(tmp_path):
    model = load_model(config_dir(tmp_path), None, "int8", load_format="dummy")
    assert model.weight_format() == "requantized blocks int8"


def test_the_synthetic_tokenizer_round_trips_text_and_names_every_other_id(tmp_path):
    tokenizer = load_tokenizer(config_dir(tmp_path), ModelConfig.from_hf(TINY))
    text = "Héllo wörld! 你好\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) == len(text.encode())
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.decode([299, 2], skip_special_tokens=True) == "<tok_299>"
    assert "<|user|>hi" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(ValueError, match="256 ids"):
        synthetic_tokenizer(ModelConfig.from_hf({**TINY, "vocab_size": 200}))


def test_a_directory_with_a_tokenizer_keeps_its_own(tiny_chat_model):
    assert load_tokenizer(tiny_chat_model, ModelConfig.from_dir(tiny_chat_model)).vocab_size == 49152


def test_devices_resolve_or_say_what_to_use_instead():
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    assert EngineConfig(device="auto").torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="random")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cpu"):
            EngineConfig(device="cuda")


def test_specserve_serve_with_dummy_weights_answers_over_http(tmp_path):
    from tests.specserve.test_server import MODEL, serve_command

    directory = config_dir(tmp_path)
    with serve_command(directory, "--load-format", "dummy", "--device", "cpu", "--draft", "none") as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 8 and completion.choices[0].text
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content
