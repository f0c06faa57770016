"""`specd` command line: generate, models, stats, serve. The engine flags and their mapping onto EngineConfig
live in config_args.py (shared with the server)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from specd.config_args import add_engine_arguments, engine_config_from_args
from specd.errors import SpecdError
from specd.llm import LLM
from specd.sampling.params import SamplingParams, SpecOverride


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
    llm = LLM.from_config(config)
    load_s = time.perf_counter() - t0
    print(f"[specd] loaded {llm.source} in {load_s:.1f}s; speculation: {config.speculation.method}", file=sys.stderr)
    chat = [{"role": "user", "content": args.prompt}]
    prompt = llm.chat_prompt(chat) if args.chat else llm.prompt(args.prompt)
    t1 = time.perf_counter()
    token_ids: list[int] = []
    text: list[str] = []
    final = None
    last_report = t1
    for delta in llm.stream(prompt, params):
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
    llm.close()  # the log line's partial last interval, and the trace file
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
    from specd.cluster.options import wants_cluster

    if wants_cluster(args):  # N engines as Ray Serve replicas (docs/cluster.md)
        from specd.cluster.launch import serve_cluster_from_args

        return serve_cluster_from_args(args)
    from specd.server.app import serve_from_args

    return serve_from_args(args)


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from specd.training.cli import run_train_draft

    return run_train_draft(args)


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

    from specd.training.cli import add_train_draft_arguments

    train = sub.add_parser("train-draft", help="train an EAGLE-style draft head for a target (self-distillation)")
    add_train_draft_arguments(train)
    train.set_defaults(func=_cmd_train_draft)

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
