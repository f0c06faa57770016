"""Why a prompt-lookup speed-up is what it is: specd's ngram vs transformers' prompt lookup, taken apart.

    .venv/bin/python bench/peer_anatomy.py [--dtype bfloat16] [--kinds code docqa] [--num-prompts 9] [--k 8]

A speed-up over plain decoding is (tokens per target forward) / (cost of a speculative forward relative to a
plain one). bench/spec.py measures the product; this script measures the two factors separately, for specd
(ngram, fixed k) and for transformers (prompt_lookup_num_tokens=k), at batch 1 on the same prompts:

1. Live: each engine's plain and speculative runs, timed, with their target forwards counted (specd: its
   metrics' sequence-steps; transformers: calls of the model's forward inside generate). Reported: ms per
   forward of each run, their ratio (the verification cost), tokens per forward, and the speed-up.
2. Replay: both proposers drafting over the same fixed texts -- specd's plain output, transformers' plain
   output and transformers' prompt-lookup output -- with greedy acceptance against that text. This is the
   proposers' tokens per forward with the text held equal: specd's own `NgramProposer` and transformers' own
   `PromptLookupCandidateGenerator`, nothing re-implemented.

The two engines' speculative outputs need not be the same text (in bfloat16 a verification forward rounds
differently from a plain one and greedy near-ties flip), and a more repetitive text is easier to draft for.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_transformers, markdown_table
from prompts import KINDS
from spec import EOS_TOKEN_ID, Run, Setting, chat_token_ids, engine_config, run_specd, run_transformers
from specd.llm import LLM
from specd.sampling.params import SamplingParams
from specd.speculation.ngram import NgramConfig, NgramProposer
from specd.speculation.proposer import SequenceView

Drafter = Callable[[list[int]], list[int]]  # context token ids -> draft token ids


def hf_generate(hf_model: Any, prompts: list[list[int]], max_tokens: int, k: int) -> tuple[Run, int]:
    """bench/spec.py's transformers run (one prompt at a time), with the target forwards it made counted."""
    calls = [0]
    hook = hf_model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        run = run_transformers(hf_model, prompts, max_tokens, k)
    finally:
        hook.remove()
    return run, calls[0]


def specd_drafter(k: int) -> Drafter:
    proposer = NgramProposer(NgramConfig())  # the engine's defaults
    params = SamplingParams(temperature=0.0)

    def draft(context: list[int]) -> list[int]:
        # One seq_id for every context: the proposer extends its index while a context grows and rebuilds it
        # when the next text starts, as it does for a running sequence.
        return proposer.propose([SequenceView(0, context, params, None)], [k]).draft_token_ids[0]

    return draft


def hf_drafter(k: int) -> Drafter:
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor([EOS_TOKEN_ID]), num_output_tokens=k, max_length=1 << 30
    )

    def draft(context: list[int]) -> list[int]:
        candidates, _ = gen.get_candidates(torch.tensor([context]))
        return candidates[0, len(context):].tolist()

    return draft


def replay(drafter: Drafter, prompts: Sequence[list[int]], texts: Sequence[list[int]]) -> float:
    """Tokens per forward when `drafter` drafts over fixed texts and greedy verification accepts the longest
    prefix that equals the text (then one token of the target's own, as in a real step)."""
    tokens = steps = 0
    for prompt, text in zip(prompts, texts, strict=True):
        pos = 0
        while pos < len(text):
            draft = drafter(prompt + text[:pos])
            accepted = 0
            while accepted < len(draft) and pos + accepted < len(text) and draft[accepted] == text[pos + accepted]:
                accepted += 1
            pos += accepted + 1
            steps += 1
        tokens += len(text)
    return tokens / steps


def live_row(kind: str, engine: str, plain: Run, plain_forwards: int, spec: Run, spec_forwards: int) -> list[Any]:
    """ms per forward of each run, their ratio (verification cost), tokens per forward and speed-up."""
    plain_ms, spec_ms = 1e3 * plain.seconds / plain_forwards, 1e3 * spec.seconds / spec_forwards
    return [kind, engine, plain_ms, spec_ms, spec_ms / plain_ms, spec.num_tokens / spec_forwards,
            spec.rate / plain.rate, spec.num_tokens]


def specd_forwards(run: Run) -> int:
    assert run.metrics is not None
    return int(run.metrics["counters"]["target_forward_seq_steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=["code", "docqa"])
    ap.add_argument("--num-prompts", type=int, default=9)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.set_defaults(draft_layers=None, threads=None)  # the rest of what spec.engine_config reads
    args = ap.parse_args()
    base = LLM("default", dtype=args.dtype, max_num_seqs=8)
    model, tokenizer = base.model, base.tokenizer
    assert tokenizer is not None
    hf_model, _ = load_transformers(torch.float32 if args.dtype == "float32" else torch.bfloat16)
    live: list[list[Any]] = []
    replays: list[list[Any]] = []
    for kind in args.kinds:
        prompts = chat_token_ids(tokenizer, kind)[: args.num_prompts]
        run_specd(model, tokenizer, engine_config(args, Setting("off")), prompts[:1], 1, 8)  # warm-up
        hf_generate(hf_model, prompts[:1], 8, 0)
        plain = run_specd(model, tokenizer, engine_config(args, Setting("off")), prompts, 1, args.max_tokens)
        spec = run_specd(model, tokenizer, engine_config(args, Setting("ngram", args.k, "fixed")), prompts, 1,
                         args.max_tokens)
        hf_plain, hf_plain_fwd = hf_generate(hf_model, prompts, args.max_tokens, 0)
        hf_pld, hf_pld_fwd = hf_generate(hf_model, prompts, args.max_tokens, args.k)

        live.append(live_row(kind, "specd ngram", plain, specd_forwards(plain), spec, specd_forwards(spec)))
        live.append(live_row(kind, "transformers pld", hf_plain, hf_plain_fwd, hf_pld, hf_pld_fwd))
        texts = {"specd plain": plain.token_ids, "transformers plain": hf_plain.token_ids,
                 "transformers pld": hf_pld.token_ids}
        for source, text in texts.items():
            replays.append([kind, source, sum(map(len, text)), replay(specd_drafter(args.k), prompts, text),
                            replay(hf_drafter(args.k), prompts, text)])
        print(f"{kind}: done", file=sys.stderr)
    print(f"### Live, batch 1, k={args.k} ({args.dtype}, {args.num_prompts} prompts per kind, greedy, "
          f"max_tokens {args.max_tokens})\n")
    print(markdown_table(["kind", "engine", "plain ms/fwd", "spec ms/fwd", "cost ratio", "tok/fwd", "speedup",
                          "tokens"], live))
    print(f"\n### Replay: tokens per forward of each proposer on the same texts (k={args.k})\n")
    print(markdown_table(["kind", "text", "tokens", "specd ngram", "transformers pld"], replays))


if __name__ == "__main__":
    main()
