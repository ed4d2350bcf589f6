"""Is the engine's bf16 error on the GPU the size of transformers' own? Against a float32 reference.

gpu_golden.py's golden check compares the engine with transformers in the same dtype; where both are
bf16 and the model magnifies rounding (the widened synthetic models), a legitimate change of kernel
(float32 softmax, another reduction order) parts them by as much as a bug would. This check measures
each side's error against transformers in float32 (TF32 off): first-step logits of each prompt, the
prompt as one chunk and as 512-token chunks over the paged prefix, default and deterministic mode.

    python bench/checks/gpu_numerics.py --synthetic smollm2-135m,gemma3-270m --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script without the project installed
    sys.path.insert(0, str(REPO))

from bench.checks.gpu_golden import first_logits, free_memory, make_synthetic, prompts_for  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def engine_for(folder: Path, device: str, is_det: bool, chunk: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            device=device,
            dtype="bfloat16",
            is_deterministic=is_det,
            max_num_seqs=16,
            max_num_batched_tokens=chunk,
            max_model_len=4096,
            kv_cache_gb=2.0,
            hicache_gb=0,
        )
    )


def hf_first_logits(
    folder: Path, prompts: dict[str, list[int]], dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    out = {}
    with torch.no_grad():
        for name, p in prompts.items():
            out[name] = model(torch.tensor([p], device=device)).logits[0, -1].float().cpu()
    del model
    free_memory()
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic", default="smollm2-135m,gemma3-270m")
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.synthetic.split(","):
            folder = make_synthetic(name, Path(tmp) / name, torch.device(args.device))
            prompts = prompts_for(folder)
            ref = hf_first_logits(folder, prompts, torch.float32, args.device)
            hf16 = hf_first_logits(folder, prompts, torch.bfloat16, args.device)
            for mode in ("default", "deterministic"):
                for chunk in (2048, 512):
                    eng = engine_for(folder, args.device, mode == "deterministic", chunk)
                    for pname, prompt in prompts.items():
                        ours = first_logits(eng, prompt) if chunk >= len(prompt) else None
                        if ours is None:  # chunked: through the scheduler, one token sampled
                            (seq,) = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
                            ours_tok = seq.output_token_ids[0]
                            rows.append(
                                dict(
                                    model=name,
                                    mode=mode,
                                    chunk=chunk,
                                    prompt=pname,
                                    argmax_same_as_fp32=ours_tok == int(ref[pname].argmax()),
                                )
                            )
                            continue
                        rows.append(
                            dict(
                                model=name,
                                mode=mode,
                                chunk=chunk,
                                prompt=pname,
                                ours_rel_l2_vs_fp32=rel(ours, ref[pname]),
                                hf_bf16_rel_l2_vs_fp32=rel(hf16[pname], ref[pname]),
                                argmax_same_as_fp32=int(ours.argmax()) == int(ref[pname].argmax()),
                                hf_argmax_same_as_fp32=int(hf16[pname].argmax()) == int(ref[pname].argmax()),
                            )
                        )
                    del eng
                    free_memory()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "numerics_check.json").write_text(json.dumps(rows, indent=1))
    print("model         mode           chunk prompt  ours-vs-fp32  hf-bf16-vs-fp32  argmax(ours/hf)")
    for r in rows:
        o = r.get("ours_rel_l2_vs_fp32")
        h = r.get("hf_bf16_rel_l2_vs_fp32")
        print(
            f"{r['model']:13} {r['mode']:14} {r['chunk']:5} {r['prompt']:6} "
            f"{'' if o is None else f'{o:.3e}':>12}  {'' if h is None else f'{h:.3e}':>15}  "
            f"{r['argmax_same_as_fp32']}/{r.get('hf_argmax_same_as_fp32', '-')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
