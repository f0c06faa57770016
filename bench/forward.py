"""Cost of one target forward by number of new tokens: what a verification step of k drafts costs.

    .venv/bin/python bench/forward.py [--dtypes float32 bfloat16 int4] [--context 256] [--batch-sizes 1 8]

For each dtype and batch size, one forward of n new tokens per sequence (n = 1 is plain decoding, n = k + 1
verifies k drafts) after a `--context`-token prefill, logits for every new token (what verification needs).
Reported: median ms per forward and its ratio to n = 1. Speculation with tau accepted-plus-bonus tokens per
step pays when tau > cost(k + 1) / cost(1) (plus the proposer's own cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.loader import load_checkpoint

DTYPES = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "int4": (torch.bfloat16, True)}


def load(dtype_name: str) -> LlamaForCausalLM:
    dtype, int4 = DTYPES[dtype_name]
    ckpt = load_checkpoint("default", torch.float32 if int4 else dtype)
    return build_model(ckpt.config, ckpt.state_dict, dtype, max_positions=4096, int4=int4)


def forward_ms(model: LlamaForCausalLM, batch_size: int, num_new: int, context: int, repeats: int) -> float:
    cache = model.make_cache(max_slots=batch_size, max_len=context + 64)
    slots = [cache.allocate() for _ in range(batch_size)]
    cache.reserve(context + num_new)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    for slot in slots:  # prefill each sequence alone, then commit
        model(ForwardBatch.build([prompt], [slot], [0], [[context - 1]]), cache)
        cache.set_len(slot, context)
    new = [torch.randint(0, vocab, (num_new,), generator=gen).tolist() for _ in slots]
    batch = ForwardBatch.build(new, slots, [context] * batch_size, [list(range(num_new))] * batch_size)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        model(batch, cache)  # writes KV at the same positions each time; nothing is committed
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = []
    for dtype_name in args.dtypes:
        model = load(dtype_name)
        for bs in args.batch_sizes:
            base = None
            for n in args.new_tokens:
                ms = forward_ms(model, bs, n, args.context, args.repeats)
                base = base or ms
                rows.append([dtype_name, bs, n, ms, ms / base])
                print(f"{dtype_name} b{bs} n={n}: {ms:.2f} ms ({ms / base:.2f}x)", file=sys.stderr)
        del model
    print(markdown_table(["dtype", "batch", "new tokens/seq", "ms/forward", "vs 1 new token"], rows))


if __name__ == "__main__":
    main()
