"""Flags and entry point of `specd train-draft`. Bad values exit 2 with a message naming the flag (via the
InvalidParameterError the configs raise)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from specd.errors import InvalidParameterError
from specd.training.run import DataConfig, summary_line, train_draft
from specd.training.split import default_prompt_set, file_prompt_set
from specd.training.trainer import TrainConfig

_DTYPES = ("float32", "bfloat16", "int4")


def add_train_draft_arguments(parser: argparse.ArgumentParser) -> None:
    data, training = DataConfig(), TrainConfig()
    parser.add_argument("--model", default="default", help="target: 'default', a HF dir or .gguf")
    parser.add_argument("--out", default=None,
                        help="directory to write the head and its report into (required unless --only generate)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="JSONL prompts (a string, {\"prompt\": ...} or {\"messages\": [...]} per line); "
                        "default: the prompt set shipped with specd")
    parser.add_argument("--dtype", default="float32", choices=_DTYPES,
                        help="the target's dtype while generating (bfloat16/int4 are faster on CPUs with AVX-512)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--samples-per-prompt", type=int, default=data.samples_per_prompt,
                        help="answers per prompt: the first greedy, the others sampled")
    parser.add_argument("--max-tokens", type=int, default=data.max_tokens, help="longest answer")
    parser.add_argument("--temperature", type=float, default=data.temperature, help="of the sampled answers")
    parser.add_argument("--batch-size", type=int, default=data.batch_size, help="answers generated at once")
    parser.add_argument("--draft-vocab-size", type=int, default=data.draft_vocab_size,
                        help="rows of the head's reduced LM head (the target's most frequent answer tokens)")
    parser.add_argument("--held-out", type=float, default=data.held_out_fraction,
                        help="share of prompts kept out of training for the report")
    parser.add_argument("--held-out-templates", type=float, default=data.held_out_templates,
                        help="share of each kind's templates (shipped prompt set) whose prompts are all kept out of "
                        "training, so one held-out figure is about unseen kinds of prompt (0: none)")
    parser.add_argument("--self-prompts", type=int, default=data.self_prompts, metavar="N",
                        help="add N prompts the target writes itself (sampled user turns, filtered; saved next to "
                        "--data-cache and reused)")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="use only the first N prompts (before the self-generated ones)")
    parser.add_argument("--generate-minutes", type=float, default=_minutes(data.max_generate_s),
                        help="stop generating after this long (answers in flight are dropped; 0: no limit)")
    parser.add_argument("--epochs", type=int, default=training.epochs)
    parser.add_argument("--batch-tokens", type=int, default=training.batch_tokens, help="padded tokens per step")
    parser.add_argument("--learning-rate", type=float, default=training.learning_rate)
    parser.add_argument("--depth", type=int, default=training.depth,
                        help="draft positions unrolled in training (EAGLE-3's training-time test; 1 = off)")
    parser.add_argument("--regression-weight", type=float, default=training.regression_weight)
    parser.add_argument("--train-minutes", type=float, default=_minutes(training.max_train_s),
                        help="stop training after this long (0: no limit)")
    parser.add_argument("--data-cache", default=None, metavar="FILE",
                        help="keep the target's answers and features in FILE: answers already there are reused, the "
                        "missing ones generated and saved every few minutes (a stopped run resumes)")
    parser.add_argument("--only", default=None, choices=("generate", "train"),
                        help="generate: stop after saving the data (needs --data-cache); train: train on "
                        "--data-cache as it is, generating nothing")
    parser.add_argument("--init-from", default=None, metavar="DIR",
                        help="go on training this saved head (its weights and draft vocabulary) instead of a new one")
    parser.add_argument("--seed", type=int, default=0)


def _minutes(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds / 60


def _seconds(flag: str, minutes: float) -> float | None:
    if minutes < 0:
        raise InvalidParameterError(flag, "must be >= 0 (0: no limit)")
    return minutes * 60 if minutes > 0 else None


def run_train_draft(args: argparse.Namespace) -> int:
    from specd.model.llama import build_model
    from specd.model.loader import load_checkpoint
    from specd.training.data import read_prompt_file

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidParameterError("--threads", "must be >= 1")
        torch.set_num_threads(args.threads)
    data = DataConfig(samples_per_prompt=args.samples_per_prompt, max_tokens=args.max_tokens,
                      temperature=args.temperature, batch_size=args.batch_size,
                      draft_vocab_size=args.draft_vocab_size, held_out_fraction=args.held_out,
                      held_out_templates=args.held_out_templates, self_prompts=args.self_prompts,
                      max_prompts=args.max_prompts,
                      max_generate_s=_seconds("--generate-minutes", args.generate_minutes),
                      seed=args.seed)
    training = TrainConfig(epochs=args.epochs, batch_tokens=args.batch_tokens, learning_rate=args.learning_rate,
                           depth=args.depth, regression_weight=args.regression_weight,
                           max_train_s=_seconds("--train-minutes", args.train_minutes),
                           seed=args.seed)
    if args.out is None and args.only != "generate":
        raise InvalidParameterError("--out", "is required (the directory to write the head into)")
    if args.only is not None and args.data_cache is None:
        raise InvalidParameterError("--only", "needs --data-cache (the data to save or to train on)")
    if args.init_from is not None and not (Path(args.init_from) / "config.json").is_file():
        raise InvalidParameterError("--init-from", f"{args.init_from} is not a head directory (no config.json)")
    prompt_set = file_prompt_set(read_prompt_file(args.prompts)) if args.prompts else default_prompt_set()
    int4 = args.dtype == "int4"
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    checkpoint = load_checkpoint(args.model, torch.float32 if int4 else dtype)
    target = build_model(checkpoint.config, checkpoint.state_dict, dtype, int4=int4)
    command = "specd train-draft " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["train-draft"] else [])
    result = train_draft(target, checkpoint.tokenizer, args.model, args.out, prompt_set, data, training,
                         command=command, data_cache=args.data_cache, generate=args.only != "train",
                         train_head=args.only != "generate", init_from=args.init_from)
    if result is None:
        print(f"[specd] saved the training data in {args.data_cache}", file=sys.stderr)
    else:
        print(f"[specd] wrote {args.out}: " + summary_line(result.report), file=sys.stderr)
    return 0
