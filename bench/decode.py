"""Plain decoding throughput: specd vs transformers `generate` on the default model, side by side.

    .venv/bin/python bench/decode.py [--max-tokens 64] [--dtypes float32 bfloat16]

Batch 1 (tokens/s) and batch 8 (aggregate tokens/s), same prompts, greedy, EOS ignored so every run
generates exactly --max-tokens tokens per sequence. specd's int4 mode is compared with transformers in
bfloat16 (its activation dtype). Each number is the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_transformers, markdown_table, timed
from specd.llm import LLM
from specd.sampling.params import SamplingParams

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, step by step.",
    "List five tips for staying focused while studying.",
    "What is the capital of France? Answer and then describe the city.",
    "Translate to French: The weather is lovely today and we are going to the park.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "Describe the water cycle to a ten-year-old.",
]


def hf_generate(model: object, tok: object, prompts: list[str], max_tokens: int) -> int:
    tok.padding_side = "left"  # type: ignore[attr-defined]
    if tok.pad_token is None:  # type: ignore[attr-defined]
        tok.pad_token = tok.eos_token  # type: ignore[attr-defined]
    enc = tok(prompts, return_tensors="pt", padding=True)  # type: ignore[operator]
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            **enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id  # type: ignore[attr-defined]
        )
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def specd_generate(llm: LLM, prompts: list[str], max_tokens: int) -> int:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs)


def best_rate(fn: Callable[[], int], repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        n, s = timed(fn)
        rates.append(n / s)
    return max(rates)


def measure_transformers(dtype: torch.dtype, max_tokens: int, repeats: int) -> tuple[float, float]:
    hf, tok = load_transformers(dtype)
    hf_generate(hf, tok, PROMPTS[:1], 4)  # warm-up
    b1 = best_rate(partial(hf_generate, hf, tok, PROMPTS[:1], max_tokens), repeats)
    b8 = best_rate(partial(hf_generate, hf, tok, PROMPTS, max_tokens), repeats)
    return b1, b8


def measure_specd(dtype_name: str, max_tokens: int, repeats: int) -> tuple[float, float]:
    llm = LLM("default", dtype=dtype_name, max_num_seqs=8)
    specd_generate(llm, PROMPTS[:1], 4)
    b1 = best_rate(partial(specd_generate, llm, PROMPTS[:1], max_tokens), repeats)
    b8 = best_rate(partial(specd_generate, llm, PROMPTS, max_tokens), repeats)
    return b1, b8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int4"],
                    help="int4 = specd's int4-weight mode, compared with transformers in bfloat16")
    args = ap.parse_args()
    rows = []
    hf_rates: dict[torch.dtype, tuple[float, float]] = {}
    for dtype_name in args.dtypes:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int4": torch.bfloat16}[dtype_name]
        if dtype not in hf_rates:
            hf_rates[dtype] = measure_transformers(dtype, args.max_tokens, args.repeats)
            gc.collect()
        hf1, hf8 = hf_rates[dtype]
        s1, s8 = measure_specd(dtype_name, args.max_tokens, args.repeats)
        gc.collect()
        rows.append([dtype_name, hf1, s1, s1 / hf1, hf8, s8, s8 / hf8, s8 / s1])
        print(f"{dtype_name}: hf b1 {hf1:.1f}  specd b1 {s1:.1f}  hf b8 {hf8:.1f}  specd b8 {s8:.1f}", file=sys.stderr)
    print(markdown_table(
        ["dtype", "transformers b1 tok/s", "specd b1 tok/s", "specd/hf b1", "transformers b8 tok/s",
         "specd b8 tok/s", "specd/hf b8", "specd b8/b1"],
        rows,
    ))


if __name__ == "__main__":
    main()
