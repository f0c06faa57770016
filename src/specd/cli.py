"""`specd` command line: generate, models, stats, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.llm import LLM
    from specd.metrics.stats import StatsSink

from specd.config import EngineConfig, SpeculationConfig
from specd.errors import SpecdError
from specd.sampling.params import SamplingParams, SpecOverride


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, engine and speculation flags shared by `generate` and `serve`."""
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct GGUF), a HF dir or .gguf")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int4"],
                   help="int4: int4 weights for decode-sized matmuls (a Q4_1 GGUF's codes kept exactly), "
                   "bfloat16 activations")
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    s = parser.add_argument_group("speculation")
    s.add_argument("--spec", default="off", choices=["off", "ngram", "draft", "layerskip"])
    s.add_argument("--num-spec-tokens", type=int, default=4, help="k_max: most draft tokens per sequence per step")
    s.add_argument("--k-policy", default="fixed", choices=["fixed", "heuristic", "confidence", "goodput"])
    s.add_argument("--draft-model", default=None, help="draft model (HF dir or .gguf) for --spec draft")
    s.add_argument("--draft-layers", type=int, default=None, help="layers used by --spec layerskip")
    s.add_argument("--ngram-min", type=int, default=1)
    s.add_argument("--ngram-max", type=int, default=4)
    s.add_argument("--confidence-threshold", type=float, default=0.5)
    s.add_argument("--spec-trace", default=None, metavar="FILE", help="write one JSON line per (step, request)")
    s.add_argument("--log-stats-interval", type=float, default=0.0, help="seconds between metric log lines")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    spec = SpeculationConfig(
        method=args.spec,
        num_speculative_tokens=args.num_spec_tokens,
        k_policy=args.k_policy,
        ngram_min_match=args.ngram_min,
        ngram_max_match=args.ngram_max,
        draft_model=args.draft_model,
        draft_layers=args.draft_layers,
        confidence_threshold=args.confidence_threshold,
    )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        speculation=spec,
        log_stats_interval_s=args.log_stats_interval,
        spec_trace_path=args.spec_trace,
        num_threads=args.threads,
    )


def build_llm(config: EngineConfig, stats_sinks: Sequence[StatsSink] = ()) -> LLM:
    """Load config.model into an LLM with every EngineConfig field honoured."""
    from specd.llm import LLM

    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("model", "speculation")}
    return LLM(config.model, speculation=config.speculation, stats_sinks=stats_sinks, **kwargs)


def _cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed_request,
        stop=list(args.stop or []),
        speculation=None if config.speculation.enabled else SpecOverride(enabled=False),
        spec_detail=args.stats_detail,
    )
    t0 = time.perf_counter()
    llm = build_llm(config)
    load_s = time.perf_counter() - t0
    print(f"[specd] loaded {llm.source} in {load_s:.1f}s; speculation: {config.speculation.method}", file=sys.stderr)
    if args.chat:
        prompt_text = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = llm.tokenizer.encode(prompt_text, add_special_tokens=False)
    else:
        prompt_text, ids = args.prompt, None
    t1 = time.perf_counter()
    token_ids: list[int] = []
    text: list[str] = []
    final = None
    last_report = t1
    for delta in llm.stream(prompt_text if ids is None else None, params, ids):
        token_ids.extend(delta.new_token_ids)
        text.append(delta.new_text)
        if not args.json:
            sys.stdout.write(delta.new_text)
            sys.stdout.flush()
        now = time.perf_counter()
        if now - last_report > 5.0:
            print(f"\n[specd] {len(token_ids)} tokens, {len(token_ids) / (now - t1):.1f} tok/s", file=sys.stderr)
            last_report = now
        final = delta
    gen_s = time.perf_counter() - t1
    assert final is not None
    stats = final.spec_stats.to_dict() if final.spec_stats is not None else None
    if args.json:
        print(json.dumps({
            "text": "".join(text),
            "token_ids": token_ids,
            "finish_reason": final.finish_reason,
            "num_prompt_tokens": final.num_prompt_tokens,
            "timings": {"load_s": load_s, "generate_s": gen_s,
                        "ttft_s": final.timings.ttft_s if final.timings else None,
                        "tokens_per_s": len(token_ids) / gen_s if gen_s > 0 else None},
            "spec_stats": stats,
        }, indent=2))
    else:
        print()
        print(f"[specd] {len(token_ids)} tokens in {gen_s:.2f}s ({len(token_ids) / max(gen_s, 1e-9):.1f} tok/s), "
              f"finish_reason={final.finish_reason}", file=sys.stderr)
        if args.stats and final.spec_stats is not None:
            from specd.metrics.report import format_request_stats

            print(format_request_stats(final.spec_stats), file=sys.stderr)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from specd.model.loader import describe_default_model

    print(json.dumps({"default": describe_default_model()}, indent=2, default=str))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from specd.metrics.trace_cli import main as stats_main

    return stats_main(args.rest)


def _cmd_serve(args: argparse.Namespace) -> int:
    from specd.server.app import serve_from_args

    return serve_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Speculative-decoding LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--request-seed", dest="seed_request", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print text, token ids, finish reason, timings as JSON")
    gen.add_argument("--stats", action="store_true", help="print the request's speculation stats")
    gen.add_argument("--stats-detail", action="store_true", help="keep per-step k_i, a_i, e_i in the stats")
    add_engine_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    models = sub.add_parser("models", help="describe the embedded default model")
    models.set_defaults(func=_cmd_models)

    stats = sub.add_parser("stats", help="summarise a --spec-trace file", add_help=False)
    stats.add_argument("rest", nargs=argparse.REMAINDER)
    stats.set_defaults(func=_cmd_stats)

    try:
        from specd.server.app import add_serve_arguments
    except ImportError:  # the server extras are optional at import time
        add_serve_arguments = None
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    if add_serve_arguments is not None:
        add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # `generate` has its own --seed (engine) and --request-seed (per request) on purpose.
    level = logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    try:
        return int(args.func(args))
    except SpecdError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
