"""Speculation speed-ups on the default model: every proposer x k x k policy vs plain decoding, side by side.

    .venv/bin/python bench/spec.py [--dtype float32] [--kinds rewrite code docqa chat] [--batch-sizes 1 8]
        [--ks 2 4 8] [--methods ngram layerskip] [--max-tokens 128] [--num-prompts 4] [--draft-layers 8]
        [--skip-transformers] [--json rows.json]

Greedy, stopping at EOS like a real user; tokens/s counts the tokens actually generated. For each prompt
kind (bench/prompts.py) and batch size: batch 1 runs the first --num-prompts prompts one at a time, batch 8
runs eight prompts of the kind in one generate call. Plain decoding (speculation off) is measured at the
start and at the end of every (kind, batch) group and the speed-ups divide by the mean of the two, so a
change in machine load during the group shows up in both sides. One target model is loaded and shared by
every configuration (a fresh LLM per configuration, so get_metrics() covers exactly that run). `match` is the
share of requests whose token ids equal plain decoding's (greedy speculation is lossless).

Peer: transformers' prompt lookup decoding (`prompt_lookup_num_tokens=k`, batch 1 only) against
transformers' plain `generate`, on the same token ids, measured in the same run.

Default sweep: 4 kinds x (plain x 2 + 6 ngram + 9 layerskip configurations) x batch {1, 8}, plus
transformers at batch 1; about 20 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_transformers, markdown_table, timed
from prompts import KINDS, prompts_of
from specd.config import DTYPES, EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams

EOS_TOKEN_ID = 2  # <|im_end|> of SmolLM2-Instruct; specd stops on the tokenizer's EOS, transformers is told
POLICIES = {"ngram": ("fixed", "heuristic"), "layerskip": ("fixed", "heuristic", "confidence")}


@dataclass(frozen=True, slots=True)
class Setting:
    """One speculation configuration; method "off" is plain decoding (k and policy unused)."""

    method: str
    k: int = 0
    policy: str = "-"


@dataclass(frozen=True, slots=True)
class Run:
    """What one configuration generated for one (kind, batch) group and how long it took."""

    token_ids: list[list[int]]  # [num_requests][num_generated_i], EOS included when hit
    seconds: float
    metrics: dict[str, Any] | None  # llm.get_metrics() after the run; None for transformers

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass(frozen=True, slots=True)
class Row:
    engine: str  # "specd" or "transformers"
    kind: str
    batch: int
    method: str
    k: int
    policy: str
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # over plain decoding of the same engine, kind and batch, measured in the same run
    match: float  # share of requests with the same token ids as plain decoding
    acceptance_rate: float | None = None  # A / T
    mean_accepted_length: float | None = None  # A / D
    tau: float | None = None  # 1 + A / D
    tokens_per_forward: float | None = None  # emitted tokens / target-forward sequence-steps


def settings_for(methods: Sequence[str], ks: Sequence[int]) -> list[Setting]:
    return [Setting(m, k, p) for m in methods for k in ks for p in POLICIES[m]]


def chat_token_ids(tokenizer: Tokenizer, kind: str) -> list[list[int]]:
    """The kind's prompts through the chat template, as llm.chat would feed them."""
    return [tokenizer.encode_chat(p.messages) for p in prompts_of(kind)]


def engine_config(args: argparse.Namespace, setting: Setting) -> EngineConfig:
    spec = SpeculationConfig()
    if setting.method != "off":
        spec = SpeculationConfig(
            method=setting.method,
            num_speculative_tokens=setting.k,
            k_policy=setting.policy,
            draft_layers=args.draft_layers if setting.method == "layerskip" else None,
        )
    return EngineConfig(model="default", dtype=args.dtype, max_num_seqs=8, speculation=spec)


def run_specd(
    model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig, prompt_ids: list[list[int]], batch: int,
    max_tokens: int,
) -> Run:
    """Generate with a fresh LLM around the shared model: one request at a time (batch 1) or all at once."""
    llm = LLM.from_model(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def generate() -> list[list[int]]:
        groups = [[ids] for ids in prompt_ids] if batch == 1 else [prompt_ids]
        outs = [o for g in groups for o in llm.generate(prompt_token_ids=g, sampling_params=params)]
        return [o.outputs[0].token_ids for o in outs]

    token_ids, seconds = timed(generate)
    return Run(token_ids, seconds, llm.get_metrics())


def run_transformers(hf_model: Any, prompt_ids: list[list[int]], max_tokens: int, k: int) -> Run:
    """transformers generate at batch 1, one prompt at a time; k > 0 turns on its prompt lookup decoding."""
    extra = {"prompt_lookup_num_tokens": k} if k else {}

    def generate() -> list[list[int]]:
        outs = []
        for ids in prompt_ids:
            inputs = torch.tensor([ids])
            with torch.inference_mode():
                out = hf_model.generate(
                    inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_tokens, do_sample=False,
                    eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, **extra,
                )
            outs.append(out[0, len(ids):].tolist())
        return outs

    token_ids, seconds = timed(generate)
    return Run(token_ids, seconds, None)


def match_rate(run: Run, reference: Run) -> float:
    return sum(a == b for a, b in zip(run.token_ids, reference.token_ids)) / len(reference.token_ids)


def make_row(engine: str, kind: str, batch: int, setting: Setting, run: Run, plain: Run, plain_rate: float) -> Row:
    rate = run.num_tokens / run.seconds
    derived = (run.metrics or {}).get("derived", {})
    return Row(
        engine, kind, batch, setting.method, setting.k, setting.policy, run.num_tokens, run.seconds, rate,
        rate / plain_rate, match_rate(run, plain),
        derived.get("acceptance_rate_pooled"),
        derived.get("mean_accepted_length_pooled"),
        derived.get("mean_acceptance_length_pooled"),
        derived.get("tokens_per_target_forward_pooled"),
    )


def measure_group(
    engine: str, kind: str, batch: int, settings: list[Setting], run_one: Callable[[Setting], Run]
) -> list[Row]:
    """Plain, every setting, plain again; speed-ups over the mean plain rate of the group."""
    plain_first = run_one(Setting("off"))
    runs = []
    for setting in settings:
        runs.append((setting, run_one(setting)))
        row_rate = runs[-1][1].num_tokens / runs[-1][1].seconds
        print(f"  {engine} {kind} b{batch} {setting.method} k={setting.k} {setting.policy}: "
              f"{row_rate:.1f} tok/s", file=sys.stderr)
    plain_last = run_one(Setting("off"))
    plain_rate = (plain_first.num_tokens / plain_first.seconds + plain_last.num_tokens / plain_last.seconds) / 2
    plain_row = make_row(engine, kind, batch, Setting("off"), plain_first, plain_first, plain_rate)
    plain_row = Row(**{**asdict(plain_row), "tokens_per_s": plain_rate, "speedup": 1.0,
                       "match": match_rate(plain_last, plain_first)})
    print(f"  {engine} {kind} b{batch} plain: {plain_rate:.1f} tok/s", file=sys.stderr)
    return [plain_row] + [make_row(engine, kind, batch, s, r, plain_first, plain_rate) for s, r in runs]


def fmt(value: float | None) -> str | float:
    return "-" if value is None else value


def table(rows: list[Row]) -> str:
    headers = ["kind", "batch", "method", "k", "policy", "tok/s", "speedup", "match", "accept", "A/D", "tau",
               "tok/fwd", "tokens"]
    return markdown_table(headers, [
        [r.kind, r.batch, r.method if r.engine == "specd" else f"hf {r.method}", r.k or "-", r.policy,
         r.tokens_per_s, r.speedup, r.match, fmt(r.acceptance_rate), fmt(r.mean_accepted_length), fmt(r.tau),
         fmt(r.tokens_per_forward), r.tokens]
        for r in rows
    ])


def best(rows: list[Row], **where: Any) -> Row | None:
    chosen = [r for r in rows if all(getattr(r, key) == value for key, value in where.items())]
    return max(chosen, key=lambda r: r.speedup, default=None)


def summary(rows: list[Row], kinds: Sequence[str]) -> str:
    lines = ["", "Summary (batch 1; best configuration per kind):"]
    verdicts = []
    for kind in kinds:
        ngram = best(rows, engine="specd", kind=kind, batch=1, method="ngram")
        pld = best(rows, engine="transformers", kind=kind, batch=1, method="pld")
        if ngram is None:
            continue
        line = f"- {kind}: specd ngram {ngram.speedup:.2f}x (k={ngram.k}, {ngram.policy})"
        if pld is not None:
            holds = ngram.speedup >= pld.speedup
            verdicts.append(holds)
            line += f" vs transformers prompt lookup {pld.speedup:.2f}x (k={pld.k}): {'ok' if holds else 'BELOW'}"
        lines.append(line)
    if verdicts:
        verdict = "HOLDS" if all(verdicts) else "FAILS"
        lines.append(f"Target ngram >= transformers prompt lookup on every kind: {verdict}")
    rewrite = best(rows, engine="specd", kind="rewrite", batch=1, method="ngram")
    if rewrite is not None:
        lines.append(f"Target ngram >= 2x on rewrite at batch 1: {'HOLDS' if rewrite.speedup >= 2.0 else 'FAILS'} "
                     f"({rewrite.speedup:.2f}x)")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--batch-sizes", nargs="+", type=int, choices=[1, 8], default=[1, 8])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--methods", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per kind at batch 1 (run one at a time)")
    ap.add_argument("--draft-layers", type=int, default=8, help="layerskip: target layers used as the draft")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path, help="write every row as JSON here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    base = LLM("default", dtype=args.dtype, max_num_seqs=8)
    model, tokenizer = base.model, base.tokenizer
    assert tokenizer is not None
    warm_ids = chat_token_ids(tokenizer, args.kinds[0])
    base.generate(prompt_token_ids=warm_ids, sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
    del base
    hf_model = None
    if not args.skip_transformers and 1 in args.batch_sizes:
        hf_model, _ = load_transformers(DTYPES[args.dtype])
        run_transformers(hf_model, warm_ids[:1], 4, 0)
    settings = settings_for(args.methods, args.ks)
    rows: list[Row] = []
    for kind in args.kinds:
        all_ids = chat_token_ids(tokenizer, kind)
        for batch in args.batch_sizes:
            prompt_ids = all_ids[: args.num_prompts] if batch == 1 else all_ids[:batch]

            def run_one(setting: Setting, ids: list[list[int]] = prompt_ids, batch: int = batch) -> Run:
                return run_specd(model, tokenizer, engine_config(args, setting), ids, batch, args.max_tokens)

            rows += measure_group("specd", kind, batch, settings, run_one)
            gc.collect()
            if hf_model is not None and batch == 1:

                def run_hf(setting: Setting, ids: list[list[int]] = prompt_ids) -> Run:
                    return run_transformers(hf_model, ids, args.max_tokens, setting.k)

                rows += measure_group("transformers", kind, 1, [Setting("pld", k) for k in args.ks], run_hf)
    for batch in args.batch_sizes:
        print(f"\n### batch {batch} ({args.dtype}, max_tokens {args.max_tokens}, greedy, stop at EOS)\n")
        print(table([r for r in rows if r.batch == batch]))
    print(summary(rows, args.kinds))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
