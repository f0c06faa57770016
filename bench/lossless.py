"""Greedy losslessness on the real model: speculative outputs vs plain decoding over the whole prompt suite.

    .venv/bin/python bench/lossless.py [--dtype float32] [--kinds ...] [--max-tokens 64] [--batch-size 8]
        [--draft-layers 8] [--methods ngram layerskip eagle hybrid] [--no-float64] [--json OUT]

Every prompt of bench/prompts.py is generated greedily (stop at EOS) with speculation off, with ngram
(k=4, heuristic), layerskip (k=4, fixed), eagle and hybrid (the shipped head, k=4, fixed); each speculative
output is compared token by token with plain decoding's. For every mismatch the script reports the first
differing position, both tokens and the target's logits at that position from a plain forward of prompt + the
common prefix, computed once in the run's dtype and once with the same weights in float64:

- `top2 gap`: top-1 minus top-2 logit of the run-dtype forward;
- `plain-spec`: logit of plain's token minus logit of the speculative token (run dtype, then float64).

A near-tie (|plain-spec| below --tie-gap in the run's dtype) that a different batch shape flips is an equally
valid greedy choice under a different reduction order, not a bug: verification computes the same logits in
a [k + 1]-token forward that plain decoding computes in 1-token forwards. A mismatch with a large gap is.
The default run (36 prompts x 3 configurations, 64 tokens) takes about 4 minutes on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table
from prompts import KINDS, Prompt, prompts_of
from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Mismatch:
    config: str
    kind: str
    prompt: str
    position: int  # first generated position where the outputs differ
    plain_token: str  # "id 'text'", or "<end>" where that output had already stopped
    spec_token: str
    top2_gap: float  # run dtype: top-1 minus top-2 logit at that position
    plain_minus_spec: float | None  # run dtype: logit(plain token) - logit(spec token); None if one ended
    plain_minus_spec_f64: float | None  # the same in float64 (None without --float64 or if one ended)
    verdict: str


def next_token_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:  # [vocab_size]
    """Logits for the token after `token_ids`, from one prefill forward in a private cache."""
    cache = model.make_cache(1, len(token_ids) + 1)
    slot = cache.allocate()
    cache.reserve(len(token_ids))
    batch = ForwardBatch.build([token_ids], [slot], [0], [[len(token_ids) - 1]])
    return model(batch, cache)[0]


def first_difference(plain: list[int], spec: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            return position
    return None if len(plain) == len(spec) else min(len(plain), len(spec))


def describe(tokenizer: Tokenizer, token_ids: list[int], position: int) -> str:
    if position >= len(token_ids):
        return "<end>"
    token = token_ids[position]
    text = repr(tokenizer.decode([token], skip_special_tokens=False)).replace("|", "\\|")  # markdown cell
    return f"{token} {text}"


def explain(
    config: str, prompt: Prompt, prompt_ids: list[int], plain: list[int], spec: list[int], position: int,
    model: LlamaForCausalLM, reference: LlamaForCausalLM | None, tokenizer: Tokenizer, tie_gap: float,
) -> Mismatch:
    context = prompt_ids + plain[:position]
    logits = next_token_logits(model, context)  # [vocab_size]
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    diff = diff64 = None
    if position < len(plain) and position < len(spec):
        plain_token, spec_token = plain[position], spec[position]
        diff = float(logits[plain_token] - logits[spec_token])
        if reference is not None:
            logits64 = next_token_logits(reference, context)
            diff64 = float(logits64[plain_token] - logits64[spec_token])
        if abs(diff) < tie_gap:
            verdict = f"near-tie (|{diff:.2g}| < {tie_gap:g}): reduction order, not a bug"
        else:
            verdict = "NOT a near-tie: investigate"
    else:
        verdict = "one output stopped earlier: investigate"
    return Mismatch(
        config, prompt.kind, prompt.name, position, describe(tokenizer, plain, position),
        describe(tokenizer, spec, position), gap, diff, diff64, verdict,
    )


def generate_all(
    model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig, prompt_ids: list[list[int]],
    batch_size: int, max_tokens: int,
) -> list[list[int]]:
    llm = LLM.from_model(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        outs += [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=chunk, sampling_params=params)]
    return outs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "int4"], default="float32")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (continuous batching)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--tie-gap", type=float, default=0.01, help="|logit difference| counted as a near-tie")
    ap.add_argument("--no-float64", action="store_true", help="skip the float64 reference forward")
    ap.add_argument("--methods", nargs="+", choices=["ngram", "layerskip", "eagle", "hybrid"],
                    default=["ngram", "layerskip", "eagle", "hybrid"], help="speculative configurations to compare")
    ap.add_argument("--json", type=Path)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    base = LLM("default", dtype=args.dtype, max_num_seqs=args.batch_size)
    model, tokenizer = base.model, base.tokenizer
    assert tokenizer is not None
    del base
    reference = None if args.no_float64 else LLM("default", dtype="float64", max_num_seqs=1).model
    prompts = [p for kind in args.kinds for p in prompts_of(kind)]
    prompt_ids = [tokenizer.encode_chat(p.messages) for p in prompts]
    configs = {
        "ngram k=4 heuristic": SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic"),
        "layerskip k=4 fixed": SpeculationConfig(
            method="layerskip", num_speculative_tokens=4, k_policy="fixed", draft_layers=args.draft_layers
        ),
        "eagle k=4 fixed": SpeculationConfig(method="eagle", num_speculative_tokens=4, k_policy="fixed"),
        "hybrid k=4 fixed": SpeculationConfig(method="hybrid", num_speculative_tokens=4, k_policy="fixed"),
    }
    configs = {name: spec for name, spec in configs.items() if spec.method in args.methods}

    def run(spec: SpeculationConfig) -> list[list[int]]:
        config = EngineConfig(dtype=args.dtype, max_num_seqs=args.batch_size, speculation=spec)
        return generate_all(model, tokenizer, config, prompt_ids, args.batch_size, args.max_tokens)

    print(f"[{time.perf_counter() - start:.0f}s] plain: {len(prompts)} prompts", file=sys.stderr)
    plain = run(SpeculationConfig())
    summary_rows, mismatches = [], []
    for name, spec in configs.items():
        print(f"[{time.perf_counter() - start:.0f}s] {name}: {len(prompts)} prompts", file=sys.stderr)
        outs = run(spec)
        matched = 0
        for prompt, ids, p, s in zip(prompts, prompt_ids, plain, outs):
            position = first_difference(p, s)
            if position is None:
                matched += 1
                continue
            mismatches.append(explain(name, prompt, ids, p, s, position, model, reference, tokenizer, args.tie_gap))
        summary_rows.append([name, f"{matched}/{len(prompts)}", matched / len(prompts)])
    print(f"[{time.perf_counter() - start:.0f}s] done", file=sys.stderr)
    print(f"\n### Greedy match vs plain decoding ({args.dtype}, max_tokens {args.max_tokens}, "
          f"batch {args.batch_size}, stop at EOS)\n")
    print(markdown_table(["config", "matched", "match rate"], summary_rows))
    if mismatches:
        print("\n### Mismatches\n")
        print(markdown_table(
            ["config", "kind", "prompt", "pos", "plain token", "spec token", "top2 gap", "plain-spec",
             "plain-spec f64", "verdict"],
            [[m.config, m.kind, m.prompt, m.position, m.plain_token, m.spec_token, f"{m.top2_gap:.4g}",
              "-" if m.plain_minus_spec is None else f"{m.plain_minus_spec:.4g}",
              "-" if m.plain_minus_spec_f64 is None else f"{m.plain_minus_spec_f64:.4g}", m.verdict]
             for m in mismatches],
        ))
    else:
        print("\nNo mismatches: every speculative output equals plain decoding token for token.")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary_rows, "mismatches": [asdict(m) for m in mismatches]},
                                        indent=1))


if __name__ == "__main__":
    main()
