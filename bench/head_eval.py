"""Draft heads side by side on the same held-out answers: greedy per-position acceptance and tau offline.

    .venv/bin/python bench/head_eval.py --data-cache data.pt --heads shipped my-head [--self-prompts N]
        [--held-out 0.05] [--held-out-templates 0.1] [--seed 0] [--json OUT]

The prompt set is rebuilt as `specd train-draft` builds it (the shipped prompts, plus the self-generated ones
saved next to the cache when --self-prompts is given), split as it splits it, and every head is scored on the
greedy answers of each held-out set: `prompts` (a random 5% of the shipped prompts, the same for every head trained
on them), `templates` (the other prompts of whole held-out templates) and `self` (held-out self-generated
prompts). A head trained before the template split existed trained on the `templates` prompts, so its figure
there is not a held-out one. A head never trained on self-generated prompts can be scored on every one of their
answers with `--all-self`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table
from specd.model.draft_head import DraftHead
from specd.model.llama import build_model
from specd.model.loader import load_checkpoint
from specd.speculation.eagle import find_shipped_head
from specd.training.data import load_samples
from specd.training.run import DataConfig, add_self_prompts, check_cache_matches, evaluate
from specd.training.split import default_prompt_set, split_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-cache", required=True, type=Path)
    parser.add_argument("--heads", nargs="+", required=True, help="head directories; 'shipped' for the package's")
    parser.add_argument("--self-prompts", type=int, default=0)
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--held-out-templates", type=float, default=0.1)
    parser.add_argument("--all-self", action="store_true",
                        help="score on every self-generated prompt's answer, not only the held-out share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    checkpoint = load_checkpoint("default", torch.float32)
    target = build_model(checkpoint.config, checkpoint.state_dict, torch.float32)
    data = DataConfig(held_out_fraction=args.held_out, held_out_templates=args.held_out_templates,
                      self_prompts=args.self_prompts, seed=args.seed)
    prompt_set = default_prompt_set()
    if args.self_prompts:
        prompt_set, _ = add_self_prompts(prompt_set, target, checkpoint.tokenizer, data, args.data_cache,
                                         generate=False)
    samples = load_samples(args.data_cache, len(prompt_set.conversations))
    check_cache_matches(samples, prompt_set, checkpoint.tokenizer, args.data_cache)
    split = split_prompts(prompt_set, data.held_out_fraction, data.held_out_templates, data.seed)
    self_indices = {i for i, kind in enumerate(prompt_set.kinds) if kind == "self"}
    sets = {"prompts": split.prompts, "templates": split.templates,
            "self": self_indices if args.all_self else split.self}
    results: dict[str, dict[str, Any]] = {}
    rows: list[list[Any]] = []
    for name in args.heads:
        directory = find_shipped_head(target) if name == "shipped" else Path(name)
        if directory is None:
            parser.error("--heads: no head is shipped for the default model")
        head = DraftHead.load(directory, target).eval()
        results[name] = {}
        for set_name, indices in sets.items():
            members = [s for s in samples if s.prompt_index in indices]
            if not any(s.greedy for s in members):
                continue
            found = evaluate(head, members)
            results[name][set_name] = found
            rows.append([name, set_name, len({s.prompt_index for s in members if s.greedy}), found["answer_tokens"],
                         " ".join(f"{a:.3f}" for a in found["acceptance_per_position"]),
                         f"{found['tau']['k=2']:.2f}", f"{found['tau']['k=4']:.2f}", f"{found['tau']['k=6']:.2f}"])
    print(markdown_table(["head", "held-out set", "prompts", "answer tokens", "acceptance per position",
                          "tau k=2", "tau k=4", "tau k=6"], rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"template_names": split.template_names, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
