"""int4 prefill: prompt rows through the q4 kernel vs through dense bfloat16 copies (SPECD_INT4_PROMPT), one process.

    .venv/bin/python bench/prefill.py [--lengths 32 128 512] [--rounds 5]

One model (the default GGUF, int4) is measured both ways, switching with LlamaForCausalLM.set_dense_prompt_rows,
the two alternating per round. Speed: median ms of one forward prefilling a prompt of each length (every row a
prompt row, logits of the last). Fidelity, on the chat-templated prompts of every kind in bench/prompts.py: the
last prompt row's logits both ways and in float32 (the GGUF's dequantized weights, no activation rounding): how often
each top-1 token matches float32's, and the mean KL(float32 || path) of the next-token distributions.
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
from prompts import KINDS, prompts_of
from specd.kernels import cpu_has_amx_bf16
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.loader import default_model_path, load_checkpoint
from specd.model.tokenizer import Tokenizer


def prefill_logits(model: LlamaForCausalLM, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """The last prompt row's logits [vocab] float32 and the forward's seconds."""
    cache = model.make_cache(max_slots=1, max_len=len(tokens) + 8)
    slot = cache.allocate()
    cache.reserve(len(tokens))
    batch = ForwardBatch.build([tokens], [slot], [0], [[len(tokens) - 1]], [True])
    start = time.perf_counter()
    logits = model(batch, cache)
    return logits[0].float(), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[32, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if any(n < 1 or n > 2048 for n in args.lengths) or args.rounds < 1:
        ap.error("--lengths must be in 1..2048 and --rounds >= 1")
    ckpt = load_checkpoint("default", torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, torch.bfloat16, max_positions=4096, int4=True)
    if not model.set_dense_prompt_rows(True):
        sys.exit("the int4 model is not on specd's q4 kernels here: nothing to compare")
    print(f"CPU has AMX-BF16: {cpu_has_amx_bf16()}; torch threads: {torch.get_num_threads()}")

    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        tokens = torch.randint(100, ckpt.config.vocab_size - 100, (length,), generator=gen).tolist()
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds + 1):  # the first round warms up
            for dense in (False, True):
                model.set_dense_prompt_rows(dense)
                seconds[dense].append(prefill_logits(model, tokens)[1])
        q4_ms, dense_ms = (statistics.median(seconds[d][1:]) * 1e3 for d in (False, True))
        rows.append([length, q4_ms, dense_ms, f"{q4_ms / dense_ms:.2f}x", q4_ms / length, dense_ms / length])
    print(markdown_table(["prompt tokens", "q4 ms", "dense bf16 ms", "speed-up", "q4 ms/token", "dense ms/token"],
                         rows))

    tokenizer = Tokenizer.from_gguf(default_model_path())
    reference = build_model(ckpt.config, ckpt.state_dict, torch.float32, max_positions=4096)
    fidelity = []
    for kind in KINDS:
        prompts = [tokenizer.encode_chat(p.messages) for p in prompts_of(kind)]
        exact = [torch.log_softmax(prefill_logits(reference, t)[0], -1) for t in prompts]
        cells: list[object] = [kind, len(prompts)]
        for dense in (False, True):
            model.set_dense_prompt_rows(dense)
            got = [torch.log_softmax(prefill_logits(model, t)[0], -1) for t in prompts]
            top1 = sum(int(g.argmax() == e.argmax()) for g, e in zip(got, exact, strict=True))
            kl = statistics.mean(float((e.exp() * (e - g)).sum()) for g, e in zip(got, exact, strict=True))
            cells += [f"{top1}/{len(prompts)}", f"{kl:.4f}"]
        fidelity.append(cells)
    print(markdown_table(["kind", "prompts", "q4 top-1 = float32", "q4 KL", "dense top-1 = float32", "dense KL"],
                         fidelity))


if __name__ == "__main__":
    main()
