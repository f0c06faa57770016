"""Speculation speed-ups on the default model: proposer x k x k policy vs plain decoding, side by side.

    .venv/bin/python bench/spec.py [--dtype float32|bfloat16|int4] [--kinds rewrite code docqa chat extract]
        [--batch-sizes 1 8 16] [--ks 2 4 8] [--layerskip-ks 4] [--eagle-ks 2 4 6] [--methods ngram layerskip eagle]
        [--policies fixed goodput adaptive ...] [--max-tokens 128]
        [--num-prompts 2] [--draft-layers 8] [--skip-transformers] [--threads N] [--json rows.json]

Greedy, stopping at EOS like a real user; tokens/s counts the tokens actually generated. For each prompt
kind (bench/prompts.py) and batch size: batch 1 runs the first --num-prompts prompts one at a time, batch 8
runs eight prompts of the kind in one generate call. Plain decoding (speculation off) is measured at the
start of every round of a (kind, batch) group and once more at its end, and speed-ups divide by the plain rate
over all of them, so a change of machine load during the group is visible (stderr prints each) and shared by
both sides. With --repeats > 1 a `per round` column gives each setting's speed-up round by round (each run over
the plain runs just before and after it) as median (min-max): the noise the pooled speed-up carries. One target
model is loaded and shared by every configuration; each configuration gets a fresh LLM around it, so its
get_metrics() covers exactly that run (acceptance A/T, A/D, tau = 1 + A/D, tokens per target forward, all
pooled). `match` is the share of requests whose token ids equal plain decoding's (greedy is lossless).

Kind `extract` (not in the default kinds) is structured output: JSON extraction from a given text, each prompt
constrained by its JSON schema (bench/prompts.py EXTRACT_SCHEMAS), batch 1 only and without the transformers peer
(it has no constrained decoding here). For it the summary also counts the output tokens the grammar forced (the
only token allowed there): a proposer that drafts them for free could at best emit every forced run in the step
of the token before it, so total / unforced tokens bounds its tau.

Peer: transformers' prompt lookup decoding (`prompt_lookup_num_tokens=k`, batch 1 only) against
transformers' plain `generate`, on the same token ids and stopping at the same EOS, in the same run.

Duration: the defaults (4 kinds x batch {1, 8} x [plain twice, ngram x {2, 4, 8} x {fixed, heuristic},
layerskip x {4} x {fixed, heuristic, confidence}], transformers at batch 1) take about 20 minutes on 2 idle CPU
cores. The full grid (`--layerskip-ks 2 4 8 --num-prompts 4`) takes about 45 minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_transformers, markdown_table, timed
from prompts import EXTRACT_KIND, EXTRACT_SCHEMAS, KINDS, prompts_of
from specd.config import DTYPES, EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.grammar import GrammarCompiler
from specd.sampling.params import SamplingParams, StructuredOutput

EOS_TOKEN_ID = 2  # <|im_end|> of SmolLM2-Instruct; specd stops on the tokenizer's EOS, transformers is told
POLICIES = {"ngram": ("fixed", "heuristic", "goodput", "adaptive"),
            "layerskip": ("fixed", "heuristic", "confidence", "adaptive"),
            "eagle": ("fixed", "confidence", "adaptive"), "hybrid": ("fixed", "confidence", "adaptive")}
# Chosen before measuring, so the headline comparison is not "the luckiest of many noisy settings".
RECOMMENDED = ("ngram", 8, "adaptive")  # `make run` and `make serve`


@dataclass(frozen=True, slots=True)
class Setting:
    """One speculation configuration; method "off" is plain decoding (k and policy unused)."""

    method: str
    k: int = 0
    policy: str = "-"
    head: str = ""  # eagle/hybrid: a head directory from --draft-heads ("": the shipped head)

    @property
    def label(self) -> str:
        return f"{self.method}:{Path(self.head).name}" if self.head else self.method


@dataclass(frozen=True, slots=True)
class Run:
    """What one configuration generated for one (kind, batch) group and how long it took."""

    token_ids: list[list[int]]  # [num_requests][num_generated_i], EOS included when hit
    seconds: float  # summed over the repeats
    metrics: dict[str, Any] | None  # llm.get_metrics() after the (first) run; None for transformers
    repeats: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def rate(self) -> float:
        return self.num_tokens * self.repeats / self.seconds

    def merged(self, other: Run) -> Run:
        """The same configuration run again (greedy: same tokens): time adds up."""
        return replace(self, seconds=self.seconds + other.seconds, repeats=self.repeats + other.repeats)


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
    accepted_tokens_per_draft: float | None = None  # A / D
    tau: float | None = None  # 1 + A / D
    tokens_per_forward: float | None = None  # emitted tokens / target forwards (steps)
    # Per round: the run's rate over the mean of the plain runs before and after it (the noise `speedup` carries).
    round_speedups: tuple[float, ...] = ()


def settings_for(args: argparse.Namespace) -> list[Setting]:
    ks_of = {"ngram": args.ks, "layerskip": args.layerskip_ks, "eagle": args.eagle_ks, "hybrid": args.eagle_ks}
    wanted = set(args.policies or [p for policies in POLICIES.values() for p in policies])
    heads_of = {m: ["", *args.draft_heads] if m in ("eagle", "hybrid") else [""] for m in args.methods}
    return [Setting(m, k, p, h) for m in args.methods for h in heads_of[m] for k in ks_of[m] for p in POLICIES[m]
            if p in wanted]


_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _START:5.0f}s] {message}", file=sys.stderr)


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
            draft_model=setting.head or None,
        )
    return EngineConfig(model="default", dtype=args.dtype, max_num_seqs=max(8, *args.batch_sizes), speculation=spec,
                        num_threads=args.threads)


def run_specd(
    model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig, prompt_ids: list[list[int]], batch: int,
    max_tokens: int, structured: Sequence[StructuredOutput] | None = None,
) -> Run:
    """Generate with a fresh LLM around the shared model: one request at a time (batch 1) or all at once.
    `structured`: one constraint per prompt (kind extract)."""
    llm = LLM.from_model(model, tokenizer, config)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                             structured=None if structured is None else structured[i]) for i in range(len(prompt_ids))]

    def generate() -> list[list[int]]:
        groups = [[i] for i in range(len(prompt_ids))] if batch == 1 else [list(range(len(prompt_ids)))]
        outs = [o for g in groups for o in llm.generate(prompt_token_ids=[prompt_ids[i] for i in g],
                                                         sampling_params=[params[i] for i in g])]
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
    rate = run.rate
    derived = (run.metrics or {}).get("derived", {})
    return Row(
        engine, kind, batch, setting.label, setting.k, setting.policy, run.num_tokens, run.seconds, rate,
        rate / plain_rate, match_rate(run, plain),
        derived.get("acceptance_rate_pooled"),
        derived.get("accepted_tokens_per_draft_pooled"),
        derived.get("mean_acceptance_length_pooled"),
        derived.get("tokens_per_target_forward_pooled"),
    )


class Group(NamedTuple):
    rows: list[Row]  # plain first, then one row per setting
    plain: Run  # the first plain run: the reference outputs of the group


def measure_group(
    engine: str, kind: str, batch: int, settings: list[Setting], run_one: Callable[[Setting], Run], repeats: int
) -> Group:
    """`repeats` rounds of [plain, every setting], then plain once more; each rate is total tokens over total
    seconds of its runs, so load changes during the group hit every setting alike. Speed-ups divide by the
    plain rate over all plain runs; each row also carries its per-round speed-ups (each run against the plain runs
    that bracket it)."""
    plain_runs: list[Run] = []
    runs: dict[Setting, Run] = {}
    rounds: dict[Setting, list[Run]] = {}
    for _ in range(repeats):
        plain_runs.append(run_one(Setting("off")))
        for setting in settings:
            run = run_one(setting)
            runs[setting] = runs[setting].merged(run) if setting in runs else run
            rounds.setdefault(setting, []).append(run)
            progress(f"{engine} {kind} b{batch} {setting.label} k={setting.k} {setting.policy}: "
                     f"{run.rate:.1f} tok/s, {run.seconds:.1f}s")
    plain_runs.append(run_one(Setting("off")))
    plain = plain_runs[0]
    for extra in plain_runs[1:]:
        plain = plain.merged(extra)
    each = ", ".join(f"{r.rate:.1f}" for r in plain_runs)
    progress(f"{engine} {kind} b{batch} plain: {plain.rate:.1f} tok/s (each run: {each})")
    plain_row = replace(
        make_row(engine, kind, batch, Setting("off"), plain, plain_runs[0], plain.rate),
        speedup=1.0, match=min(match_rate(r, plain_runs[0]) for r in plain_runs),
    )
    rows = [replace(make_row(engine, kind, batch, s, r, plain_runs[0], plain.rate),
                    round_speedups=round_speedups(rounds[s], plain_runs) if repeats > 1 else ())
            for s, r in runs.items()]
    return Group([plain_row, *rows], plain_runs[0])


def round_speedups(runs: Sequence[Run], plain_runs: Sequence[Run]) -> tuple[float, ...]:
    """Run i's rate over the mean rate of plain runs i and i + 1 (the ones measured just before and after it)."""
    return tuple(run.rate / ((plain_runs[i].rate + plain_runs[i + 1].rate) / 2) for i, run in enumerate(runs))


def spread(values: Sequence[float]) -> str:
    """'median (min-max)' of a row's per-round speed-ups, '-' without rounds."""
    if len(values) < 2:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def fmt(value: float | None) -> str | float:
    return "-" if value is None else value


def table(rows: list[Row]) -> str:
    """The rows as markdown; with rounds, a column of each row's per-round speed-ups (median, range)."""
    in_rounds = any(r.round_speedups for r in rows)
    headers = ["kind", "batch", "method", "k", "policy", "tok/s", "speedup", "match", "accept", "A/D", "tau",
               "tok/fwd", "tokens"] + (["per round"] if in_rounds else [])
    return markdown_table(headers, [
        [r.kind, r.batch, r.method if r.engine == "specd" else f"hf {r.method}", r.k or "-", r.policy,
         r.tokens_per_s, r.speedup, r.match, fmt(r.acceptance_rate), fmt(r.accepted_tokens_per_draft), fmt(r.tau),
         fmt(r.tokens_per_forward), r.tokens] + ([spread(r.round_speedups)] if in_rounds else [])
        for r in rows
    ])


def best(rows: list[Row], **where: Any) -> Row | None:
    chosen = [r for r in rows if all(getattr(r, key) == value for key, value in where.items())]
    return max(chosen, key=lambda r: r.speedup, default=None)


def summary(rows: list[Row], kinds: Sequence[str], peer_agreement: dict[str, float]) -> str:
    """Two comparisons per kind at batch 1: specd's recommended setting (fixed before measuring) against
    transformers' best k, which is the conservative one, and best against best."""
    method, k, policy = RECOMMENDED
    lines = ["", f"Summary (batch 1). specd's recommended setting is ngram k={k} {policy}, chosen in advance; "
             "transformers gets its best k."]
    verdicts = []
    for kind in kinds:
        chosen = best(rows, engine="specd", kind=kind, batch=1, method=method, k=k, policy=policy)
        ngram = best(rows, engine="specd", kind=kind, batch=1, method="ngram")
        pld = best(rows, engine="transformers", kind=kind, batch=1, method="pld")
        if ngram is None:
            continue
        line = f"- {kind}:"
        if chosen is not None:
            line += f" specd recommended {chosen.speedup:.2f}x;"
        line += f" specd best {ngram.speedup:.2f}x (k={ngram.k}, {ngram.policy})"
        if pld is not None:
            headline = chosen or ngram
            holds = headline.speedup >= pld.speedup
            verdicts.append(holds)
            line += f"; transformers prompt lookup best {pld.speedup:.2f}x (k={pld.k}): {'ok' if holds else 'BELOW'}"
        if kind in peer_agreement:
            line += f"; transformers plain = specd plain on {peer_agreement[kind]:.0%} of requests"
        wide = best(rows, engine="specd", kind=kind, batch=8, method="ngram")
        if wide is not None:
            line += f"; batch 8: ngram best {wide.speedup:.2f}x (k={wide.k}, {wide.policy})"
            wide_chosen = best(rows, engine="specd", kind=kind, batch=8, method=method, k=k, policy=policy)
            if wide_chosen is not None:
                line += f", recommended {wide_chosen.speedup:.2f}x"
        lines.append(line)
    if verdicts:
        verdict = "HOLDS" if all(verdicts) else "FAILS"
        lines.append("Target ngram (recommended setting) >= transformers prompt lookup (best k) on every kind: "
                     + verdict)
    rewrite = best(rows, engine="specd", kind="rewrite", batch=1, method=method, k=k, policy=policy) or best(
        rows, engine="specd", kind="rewrite", batch=1, method="ngram")
    if rewrite is not None:
        lines.append(f"Target ngram >= 2x on rewrite at batch 1: {'HOLDS' if rewrite.speedup >= 2.0 else 'FAILS'} "
                     f"({rewrite.speedup:.2f}x, k={rewrite.k} {rewrite.policy})")
    return "\n".join(lines)


def extract_constraints(num_prompts: int) -> list[StructuredOutput]:
    return [StructuredOutput("json_schema", EXTRACT_SCHEMAS[p.name]) for p in prompts_of(EXTRACT_KIND)[:num_prompts]]


def forced_counts(tokenizer: Tokenizer, vocab_size: int, outputs: list[list[int]],
                  constraints: list[StructuredOutput]) -> tuple[int, int]:
    """(forced, total) output tokens: forced where the grammar allowed that token alone (replayed per token)."""
    compiler = GrammarCompiler(tokenizer.backend_json(), vocab_size, tokenizer.eos_token_ids)
    forced = total = 0
    for tokens, constraint in zip(outputs, constraints, strict=True):
        grammar = compiler.json_schema(constraint.value)
        for token in tokens:
            if token in tokenizer.eos_token_ids and grammar.finished:
                break
            forced += bool(grammar.forced_tokens())
            total += 1
            grammar.advance([token])
    return forced, total


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "int4"], default="bfloat16",
                    help="specd dtype; transformers runs in float32, or bfloat16 for bfloat16 and int4")
    ap.add_argument("--kinds", nargs="+", choices=[*KINDS, EXTRACT_KIND], default=list(KINDS),
                    help=f"{EXTRACT_KIND}: structured output (JSON extraction under a schema), not in the default set")
    ap.add_argument("--batch-sizes", nargs="+", type=int, choices=[1, 8, 16], default=[1, 8])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8], help="k of ngram and of transformers' lookup")
    ap.add_argument("--layerskip-ks", nargs="+", type=int, default=[4], help="k of layerskip (full grid: 2 4 8)")
    ap.add_argument("--eagle-ks", nargs="+", type=int, default=[2, 4, 6], help="k of eagle, hybrid")
    ap.add_argument("--methods", nargs="+", choices=list(POLICIES), default=["ngram", "layerskip"])
    ap.add_argument("--draft-heads", nargs="+", default=[], metavar="DIR",
                    help="eagle/hybrid also with these heads (rows method:DIRNAME), beside the shipped one")
    ap.add_argument("--policies", nargs="+", choices=sorted({p for ps in POLICIES.values() for p in ps}),
                    help="only these k policies (default: every policy of each method)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per kind at batch 1 (run one at a time)")
    ap.add_argument("--draft-layers", type=int, default=8, help="layerskip: target layers used as the draft")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--threads", type=int, help="torch threads for specd and transformers (default: torch's)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every setting per (kind, batch) group")
    ap.add_argument("--json", type=Path, help="write the settings and every row as JSON here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    base = LLM("default", dtype=args.dtype, max_num_seqs=8, num_threads=args.threads)  # threads: process-wide
    model, tokenizer = base.model, base.tokenizer
    assert tokenizer is not None
    warm_ids = chat_token_ids(tokenizer, args.kinds[0])  # every batch shape the groups will use, briefly
    base.generate(prompt_token_ids=warm_ids, sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
    del base
    hf_model = None
    if not args.skip_transformers and 1 in args.batch_sizes:
        hf_model, _ = load_transformers(DTYPES[args.dtype])
        run_transformers(hf_model, warm_ids[:1], 4, 0)
    settings = settings_for(args)
    progress(f"loaded; {len(settings)} speculative settings per (kind, batch)")
    rows: list[Row] = []
    peer_agreement: dict[str, float] = {}
    forced_lines: list[str] = []
    for kind in args.kinds:
        all_ids = chat_token_ids(tokenizer, kind)
        extract = kind == EXTRACT_KIND
        for batch in args.batch_sizes:
            if extract and batch != 1:
                progress(f"{kind}: batch 1 only (it has {len(all_ids)} prompts); batch {batch} skipped")
                continue
            # A batch larger than the kind's prompts repeats them (9 per kind: batch 16 holds 7 twice).
            prompt_ids = all_ids[: args.num_prompts] if batch == 1 else (all_ids * batch)[:batch]
            constraints = extract_constraints(len(prompt_ids)) if extract else None

            def run_one(setting: Setting, ids: list[list[int]] = prompt_ids, batch: int = batch,
                        constraints: list[StructuredOutput] | None = constraints) -> Run:
                return run_specd(model, tokenizer, engine_config(args, setting), ids, batch, args.max_tokens,
                                 constraints)

            group = measure_group("specd", kind, batch, settings, run_one, args.repeats)
            rows += group.rows
            gc.collect()
            if constraints is not None:
                forced, total = forced_counts(tokenizer, model.config.vocab_size, group.plain.token_ids, constraints)
                forced_lines.append(
                    f"- {kind}: the grammar forced {forced} of {total} output tokens ({forced / max(total, 1):.0%}); "
                    f"drafting them for free could at best reach tau = {total / max(total - forced, 1):.2f}")
            if hf_model is not None and batch == 1 and not extract:

                def run_hf(setting: Setting, ids: list[list[int]] = prompt_ids) -> Run:
                    return run_transformers(hf_model, ids, args.max_tokens, setting.k)

                peer = measure_group("transformers", kind, 1, [Setting("pld", k) for k in args.ks], run_hf,
                                     args.repeats)
                rows += peer.rows
                peer_agreement[kind] = match_rate(peer.plain, group.plain)
    for batch in args.batch_sizes:
        print(f"\n### batch {batch} ({args.dtype}, max_tokens {args.max_tokens}, greedy, stop at EOS)\n")
        print(table([r for r in rows if r.batch == batch]))
    print(summary(rows, args.kinds, peer_agreement))
    print("\n".join(forced_lines))
    if args.json:
        settings_json = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings_json, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
