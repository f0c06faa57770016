"""Self-distillation data for a draft head: the target answers prompts with specd's own engine, and the very
forwards that generate the answers record the target's feature at every position (no second pass over the text:
on a CPU that pass would cost as much as generating)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from specd.config import EngineConfig
from specd.errors import InvalidParameterError
from specd.model.attention import ForwardBatch
from specd.model.kv_cache import KVCache
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams
from specd.training.progress import Progress

Conversation = list[dict[str, str]]


class Sample(NamedTuple):
    """A training sequence: a prompt and the target's answer, without the answer's last token (the target never
    read it, so it has no feature). features[p] is the target's final normed hidden state at position p, the
    vector its LM head read to choose token p + 1."""

    prompt_index: int
    token_ids: torch.Tensor  # [num_tokens] int64, prompt + answer[:-1]
    num_prompt_tokens: int
    features: torch.Tensor  # [num_tokens, hidden_size] bfloat16
    greedy: bool
    sample: int = 0  # which answer of its prompt: 0 is the greedy one, 1.. are sampled

    @property
    def job(self) -> tuple[int, int]:
        return self.prompt_index, self.sample

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()


class _FeatureRecorder:
    """Stands in for the target inside the engine: every forward also returns the final normed hidden states,
    kept per KV slot by position (a later write at a position replaces the earlier one, as in the KV cache)."""

    def __init__(self, target: LlamaForCausalLM, max_slots: int, max_len: int) -> None:
        self._target = target
        self.tokens: list[list[int]] = [[] for _ in range(max_slots)]
        self.features = torch.zeros(max_slots, max_len, target.config.hidden_size, dtype=torch.bfloat16)

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def __call__(self, batch: ForwardBatch, cache: KVCache, num_layers: int | None = None) -> torch.Tensor:
        out = self._target.forward_with_hidden(batch, cache, num_layers, hidden_layers=(-1,))
        assert out.hidden_states is not None
        offset = 0
        for slot, start, count in zip(batch.slot_ids, batch.start_positions, batch.num_new_tokens):
            rows = out.hidden_states[offset : offset + count]  # [count, hidden_size]
            self.features[slot, start : start + count] = rows.to(torch.bfloat16)
            self.tokens[slot][start:] = batch.token_ids[offset : offset + count].tolist()
            offset += count
        return out.logits

    def take(self, ids: Sequence[int]) -> torch.Tensor:  # [len(ids) - 1, hidden_size]
        """The features of a finished sequence `ids` (prompt + answer): every position but the last."""
        read = list(ids[:-1])
        for slot, tokens in enumerate(self.tokens):
            if tokens[: len(read)] == read:
                return self.features[slot, : len(read)].clone()
        raise RuntimeError("no KV slot holds the finished sequence's tokens")  # an engine invariant broke


def read_prompt_file(path: str | Path) -> list[Conversation]:
    """A JSONL file: each line a JSON string (one user turn), {"prompt": text}, or {"messages": [{role, content}]}.
    Errors name the flag and the line."""
    file = Path(path)
    if not file.is_file():
        raise InvalidParameterError("--prompts", f"{file} is not a file")
    conversations: list[Conversation] = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError("--prompts", f"{file}:{number}: not JSON ({exc.msg})") from exc
        if isinstance(item, str):
            item = {"prompt": item}
        if isinstance(item, Mapping) and isinstance(item.get("prompt"), str) and item["prompt"].strip():
            conversations.append([{"role": "user", "content": item["prompt"]}])
        elif isinstance(item, Mapping) and _is_messages(item.get("messages")):
            conversations.append([{"role": m["role"], "content": m["content"]} for m in item["messages"]])
        else:
            raise InvalidParameterError(
                "--prompts", f"{file}:{number}: expected a string, {{\"prompt\": text}} or {{\"messages\": [...]}}"
            )
    if not conversations:
        raise InvalidParameterError("--prompts", f"{file} holds no prompts")
    return conversations


def _is_messages(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )


def generate_samples(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    conversations: Sequence[Conversation],
    samples_per_prompt: int,
    max_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    max_seconds: float | None = None,
    done: Collection[tuple[int, int]] = (),
    checkpoint: Callable[[list[Sample]], None] | None = None,
    checkpoint_every_s: float = 300.0,
) -> list[Sample]:
    """Answer every conversation `samples_per_prompt` times with specd's engine (continuous batching): the first
    answer greedy, the others sampled at `temperature` (top-p 0.95) with per-request seeds. Returns them with the
    target's features, recorded by the generating forwards. After `max_seconds` the answers still being generated
    are dropped and the rest returned (the order of jobs is every prompt once, then every prompt again, ...).

    done: (prompt index, sample) jobs already answered (a resumed run): skipped. checkpoint: called with every
    answer finished so far, at most every `checkpoint_every_s` and once at the end, so a long run can be saved as it
    goes. A job's answer depends only on its prompt, its sample number and the seed, not on what else was generated.
    """
    from specd.llm import LLM

    prompt_ids = [tokenizer.encode_chat(c) for c in conversations]
    longest = max(len(p) for p in prompt_ids) + max_tokens + 1
    config = EngineConfig(max_num_seqs=batch_size, max_model_len=longest,
                          max_num_batched_tokens=max(512, batch_size))
    recorder = _FeatureRecorder(target, batch_size, longest)
    llm = LLM.from_model(recorder, tokenizer, config)  # type: ignore[arg-type]  # duck-typed stand-in
    skip = set(done)
    jobs = [(i, s) for s in range(samples_per_prompt) for i in range(len(prompt_ids)) if (i, s) not in skip]
    if not jobs:
        return []
    results: dict[str, Sample] = {}
    progress = Progress("generate", len(jobs) * max_tokens, "tokens (at most)")
    pending = iter(jobs)
    tokens: dict[str, list[int]] = {}
    meta: dict[str, tuple[int, int]] = {}
    in_flight = 0
    produced = 0

    def submit() -> bool:
        job = next(pending, None)
        if job is None:
            return False
        index, sample = job
        greedy = sample == 0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else temperature,
                                top_p=1.0 if greedy else 0.95, seed=seed + 7919 * sample + index)
        rid = llm.add_request(None, params, prompt_token_ids=prompt_ids[index])
        tokens[rid], meta[rid] = [], (index, sample)
        return True

    while in_flight < batch_size and submit():
        in_flight += 1
    started = last_checkpoint = time.monotonic()

    def finished() -> list[Sample]:
        return [results[rid] for rid in sorted(results, key=lambda r: int(r.rsplit("-", 1)[1]))]

    while in_flight:
        if max_seconds is not None and time.monotonic() - started > max_seconds:
            for rid in list(tokens):
                llm.abort(rid)
            break
        for delta in llm.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            produced += len(delta.new_token_ids)
            if delta.finished:
                index, sample = meta[delta.request_id]
                ids = prompt_ids[index] + tokens.pop(delta.request_id)
                features = recorder.take(ids)
                results[delta.request_id] = Sample(index, torch.tensor(ids[:-1], dtype=torch.long),
                                                   len(prompt_ids[index]), features, sample == 0, sample)
                # The ETA counts every answer as max_tokens long; one that ends early counts as done.
                progress.advance(max_tokens, note=f"{produced} generated")
                in_flight -= 1
                if submit():
                    in_flight += 1
        if checkpoint is not None and time.monotonic() - last_checkpoint > checkpoint_every_s:
            checkpoint(finished())
            last_checkpoint = time.monotonic()
    progress.finish()
    if not results and not skip:
        raise InvalidParameterError("--generate-minutes", "no answer was finished in time")
    if checkpoint is not None:
        checkpoint(finished())
    return finished()


def save_samples(path: Path, samples: Sequence[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([tuple(sample) for sample in samples], path)


def load_samples(path: Path, num_prompts: int) -> list[Sample]:
    """Samples saved by `save_samples`; refuses a file made for a different prompt list."""
    try:
        samples = [Sample(*fields) for fields in torch.load(path, weights_only=True)]
    except Exception as exc:  # any unreadable file: torch raises several unrelated types
        raise InvalidParameterError("--data-cache", f"{path} is not a training-data file ({exc})") from exc
    if not samples or any(not 0 <= s.prompt_index < num_prompts for s in samples):
        raise InvalidParameterError("--data-cache", f"{path} was made for other prompts")
    return samples


def frequent_tokens(samples: Sequence[Sample], vocab_size: int, draft_vocab_size: int,
                    always: Sequence[int] = ()) -> torch.Tensor:  # [draft_vocab_size] int64 target ids
    """The draft vocabulary: `always` (e.g. EOS), then the tokens the target emitted most often in its answers,
    then the lowest unused ids if the answers use fewer distinct tokens."""
    counts = Counter(t for s in samples for t in s.response_ids)
    chosen: list[int] = []
    seen: set[int] = set()
    ranked = [t for t in always if 0 <= t < vocab_size] + [t for t, _ in counts.most_common()]
    for token in ranked + list(range(vocab_size)):
        if len(chosen) == draft_vocab_size:
            break
        if token not in seen:
            seen.add(token)
            chosen.append(token)
    return torch.tensor(chosen, dtype=torch.long)
