"""GPU correctness checks, run on the GPU machine before speed numbers mean anything.

  golden       greedy tokens of the engine (default and deterministic mode) against transformers,
               same checkpoint, same dtype (bf16 on CUDA), prompts one at a time. Where they part,
               the reference's top-2 logit gap at that step must be under --tie-gap (a near-tie,
               reported); also the first step's logits, engine vs transformers.
  determinism  deterministic mode: each prompt alone (whole prompt in one chunk) against all prompts
               batched with random-token neighbours and a small token budget (chunked prefill, changing
               batch composition): tokens and their logprobs must be bit-identical.

Models: `--model NAME=SRC`, SRC a Hugging Face folder, a .gguf file (converted here with the project's
converter, engine.checkpoints.convert) or GGUF parts joined by '+'. `--synthetic` adds random-weight models
with the real models' shapes (Gemma 3 270M, SmolLM2 135M) and widened weights so greedy steps have clear
winners: they exercise the same code paths, but they are no substitute for a real checkpoint's golden
check and are reported apart.

    python bench/checks/gpu_golden.py --model smollm2=/path/to/folder --synthetic gemma3-270m --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import inspect
import json
import json.decoder
import json.encoder
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.config import EngineConfig  # noqa: E402
from engine.core.sequence import Sequence  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

LONG_PROMPT_TOKENS = 1150  # over 1,100: several of Gemma 3's 512-token windows slide

# Real models' shapes for the synthetic checks (config.json fields).
SYNTHETIC: dict[str, dict[str, Any]] = {
    "gemma3-270m": dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, vocab_size=262144,
        sliding_window=512, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100_000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    ),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- models --------------------------------------------------------------------------------------


def prepare_model(name: str, src: str, scratch: Path) -> Path:
    """A Hugging Face folder for SRC (see the module docstring)."""
    parts = [Path(p) for p in src.split("+")]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{name}: not found: {', '.join(missing)}")
    if len(parts) == 1 and parts[0].is_dir():
        return parts[0]
    gguf = parts[0]
    if len(parts) > 1:
        gguf = scratch / f"{name}.gguf"
        with gguf.open("wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    log(f"{name}: GGUF {gguf.stat().st_size / 2**20:.1f} MiB, sha256 {digest}")
    from engine.checkpoints.convert import gguf_to_hf

    folder = scratch / name
    t0 = time.monotonic()
    gguf_to_hf(gguf, folder, log)
    log(f"{name}: converted in {time.monotonic() - t0:.0f} s")
    return folder


def weights_digest(folder: Path) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: the same on any machine for the same
    checkpoint, whichever transformers version wrote the file."""
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in sorted(st.keys()):
                t = st.get_tensor(key).contiguous()
                h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def make_synthetic(name: str, folder: Path, device: torch.device, seed: int = 0) -> Path:
    """Random weights in a real model's shape, widened so greedy steps have clear winners."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SYNTHETIC[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    is_gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0 if is_gemma else 1.0, 0.1)
            elif "embed" in pname or "lm_head" in pname:
                p.normal_(0.0, 0.25)
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    del model
    free_memory()
    return folder


# ---- prompts -------------------------------------------------------------------------------------


def prompts_for(folder: Path, seed: int = 0) -> dict[str, list[int]]:
    """A short chat prompt and a long one (> 1,100 tokens of Python source), as the CPU golden tests
    build them; random token ids for a folder without a tokenizer (synthetic models)."""
    has_tokenizer = (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()
    if not has_tokenizer:
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(seed)
        return {
            "short": torch.randint(10, vocab, (40,), generator=gen).tolist(),
            "long": torch.randint(10, vocab, (LONG_PROMPT_TOKENS,), generator=gen).tolist(),
        }
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in a few sentences why the sky is blue, then name three planets."},
    ]
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        short = tok(text, add_special_tokens=False)["input_ids"]
    else:
        short = tok("The sky is blue because", add_special_tokens=True)["input_ids"]
    source = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    long = tok(source, add_special_tokens=True)["input_ids"][:LONG_PROMPT_TOKENS]
    return {"short": list(short), "long": list(long)}


# ---- golden --------------------------------------------------------------------------------------


def hf_reference(folder: Path, prompts: dict[str, list[int]], new_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """transformers' greedy tokens, per-step float32 logits and first-step logits, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, prompt in prompts.items():
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )
            out[name] = {
                "tokens": gen.sequences[0, len(prompt):].tolist(),
                "logits": [x[0].float().cpu() for x in gen.logits],
            }
    del model
    free_memory()
    return out


def engine_for(folder: Path, device: torch.device, dtype: torch.dtype, is_det: bool, chunk: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(folder), device=str(device), dtype=str(dtype).removeprefix("torch."), is_deterministic=is_det,
        max_num_seqs=16, max_num_batched_tokens=chunk, max_model_len=4096, kv_cache_gb=2.0,
    ))


def first_logits(eng: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The last prompt position's logits, the whole prompt as one chunk."""
    seq = Sequence("first", prompt, SamplingParams(), 0, 0.0)
    eng.scheduler.allocate(seq)
    try:
        _, logits = eng.runner.run([seq], [len(prompt)])
    finally:
        eng.scheduler.release(seq)
    assert logits is not None
    return logits[0].float().cpu()


def top2_gap(logits: torch.Tensor) -> tuple[float, list[int]]:
    v, i = torch.topk(logits.float(), 2)
    return float(v[0] - v[1]), i.tolist()


def compare(ours: list[int], ref: dict[str, Any], tie_gap: float) -> dict[str, Any]:
    n = len(ref["tokens"])
    for step, (a, b) in enumerate(zip(ours, ref["tokens"])):
        if a != b:
            gap, top = top2_gap(ref["logits"][step])
            return {
                "status": "near-tie" if gap < tie_gap else "FAIL", "identical_steps": step, "of": n,
                "step": step, "ours": a, "ref": b, "ref_top2": top, "ref_gap": gap,
            }
    return {"status": "identical" if len(ours) == n else "FAIL", "identical_steps": min(len(ours), n), "of": n}


def golden(folder: Path, device: torch.device, dtype: torch.dtype, new_tokens: int, tie_gap: float,
           prompts: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    prompts = prompts or prompts_for(folder)
    ref = hf_reference(folder, prompts, new_tokens, device, dtype)
    results = []
    for mode in ("default", "deterministic"):
        eng = engine_for(folder, device, dtype, mode == "deterministic", chunk=2048)
        for name, prompt in prompts.items():
            first = first_logits(eng, prompt)
            ref_first = ref[name]["logits"][0]
            diff = (first - ref_first).abs()
            (seq,) = eng.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
            res = compare(seq.output_token_ids, ref[name], tie_gap)
            res.update(
                mode=mode, prompt=name, prompt_tokens=len(prompt),
                first_max_abs_diff=float(diff.max()),
                first_rel_l2=float((first - ref_first).norm() / ref_first.norm()),
                first_argmax_same=int(first.argmax()) == int(ref_first.argmax()),
                first_ref_gap=top2_gap(ref_first)[0],
            )
            results.append(res)
        eng.check_idle()
        del eng
        free_memory()
    return results


# ---- determinism ---------------------------------------------------------------------------------


def determinism(folder: Path, device: torch.device, dtype: torch.dtype, new_tokens: int,
                prompts: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    prompts = prompts or prompts_for(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    alone: dict[str, tuple[list[int], list[float]]] = {}
    eng = engine_for(folder, device, dtype, True, chunk=2048)
    for name, prompt in prompts.items():
        (seq,) = eng.generate([prompt], params)
        alone[name] = (seq.output_token_ids, [lp.logprob for lp in seq.output_logprobs])
    eng.check_idle()
    del eng
    free_memory()
    # Batched: the prompts among random neighbours of several lengths, a 256-token budget, so prompts
    # are chunked at other places and decode with a batch that shrinks as neighbours finish.
    gen = torch.Generator().manual_seed(1)
    neighbours = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (37, 300, 515, 1029)]
    names = list(prompts)
    batch = [neighbours[0], prompts[names[0]], neighbours[1], neighbours[2], *[prompts[n] for n in names[1:]],
             neighbours[3]]
    plist = [dataclasses.replace(params, max_tokens=new_tokens // 2 + 3 * i) for i in range(len(batch))]
    for i, p in enumerate(batch):
        if any(p is prompts[n] for n in names):
            plist[i] = params
    eng = engine_for(folder, device, dtype, True, chunk=256)
    seqs = eng.generate(batch, plist)
    eng.check_idle()
    del eng
    free_memory()
    results = []
    for name in names:
        idx = next(i for i, p in enumerate(batch) if p is prompts[name])
        seq = seqs[idx]
        tokens, lps = seq.output_token_ids, [lp.logprob for lp in seq.output_logprobs]
        ref_tokens, ref_lps = alone[name]
        results.append({
            "prompt": name, "prompt_tokens": len(prompts[name]), "new_tokens": len(tokens),
            "tokens_identical": tokens == ref_tokens, "logprobs_bit_identical": lps == ref_lps,
            "status": "identical" if tokens == ref_tokens and lps == ref_lps else "FAIL",
            "first_token_difference": next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None),
        })
    return results


# ---- main ----------------------------------------------------------------------------------------


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for model, r in report["models"].items():
        tag = " [synthetic weights: not a real-checkpoint golden]" if r.get("synthetic") else ""
        if "error" in r:
            lines.append(f"{model}{tag}: NOT RUN: {r['error']}")
            continue
        for g in r.get("golden", []):
            s = f"{model}{tag} golden {g['mode']:<13} {g['prompt']:<5} ({g['prompt_tokens']} tok): "
            if g["status"] == "identical":
                s += f"{g['identical_steps']}/{g['of']} tokens identical"
            else:
                s += (f"{g['status']}: identical for {g['identical_steps']}/{g['of']} steps, then ours {g['ours']} vs "
                      f"ref {g['ref']} (ref top-2 gap {g['ref_gap']:.4f})")
            s += f"; first-step logits max |diff| {g['first_max_abs_diff']:.3f}, rel L2 {g['first_rel_l2']:.2e}"
            lines.append(s)
        for d in r.get("determinism", []):
            lines.append(f"{model}{tag} deterministic batched vs alone, {d['prompt']} ({d['prompt_tokens']} tok): "
                         f"{d['status']} (tokens {'same' if d['tokens_identical'] else 'DIFFER'}, logprobs "
                         f"{'bit-identical' if d['logprobs_bit_identical'] else 'DIFFER'}, {d['new_tokens']} tokens)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="NAME=SRC (repeatable)")
    p.add_argument("--synthetic", default="", help=f"comma list of {sorted(SYNTHETIC)}")
    p.add_argument("--checks", default="golden,determinism")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tie-gap", type=float, default=0.05)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    checks = set(args.checks.split(","))
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "torch": torch.__version__, "transformers": transformers.__version__,
        "new_tokens": args.new_tokens, "tie_gap": args.tie_gap, "models": {},
    }
    jobs = [(m.split("=", 1)[0], m.split("=", 1)[1], False) for m in args.model]
    jobs += [(n, "", True) for n in args.synthetic.split(",") if n]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch_dir:
        scratch = Path(scratch_dir)
        for name, src, is_synthetic in jobs:
            key = f"{name} (synthetic)" if is_synthetic else name
            entry: dict[str, Any] = {"synthetic": is_synthetic}
            report["models"][key] = entry
            t0 = time.monotonic()
            try:
                if is_synthetic:
                    folder = make_synthetic(name, scratch / f"synthetic-{name}", device)
                else:
                    folder = prepare_model(name, src, scratch)
                if not is_synthetic:
                    entry["weights_sha256"] = weights_digest(folder)
                    log(f"{name}: weights digest {entry['weights_sha256']}")
                prompts = prompts_for(folder)
                entry["prompt_tokens"] = {k: len(v) for k, v in prompts.items()}
                if "golden" in checks:
                    entry["golden"] = golden(folder, device, dtype, args.new_tokens, args.tie_gap, prompts)
                if "determinism" in checks:
                    entry["determinism"] = determinism(folder, device, dtype, args.new_tokens, prompts)
            except Exception as e:  # one model's failure is reported, the others still run
                import traceback

                traceback.print_exc()
                entry["error"] = f"{type(e).__name__}: {e}"
            entry["wall_s"] = round(time.monotonic() - t0, 1)
            for line in summary_lines({"models": {key: entry}}):
                log(line)
    lines = summary_lines(report)
    failed = [ln for ln in lines if "FAIL" in ln or "DIFFER" in ln or "NOT RUN" in ln]
    log(f"\n== gpu_golden summary ({report['device']}, {report['dtype']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, {time.monotonic() - t_start:.0f} s)")
    for line in lines:
        log(line)
    log("gpu_golden: " + ("all passed" if not failed else f"{len(failed)} line(s) failed or not run"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_golden.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
