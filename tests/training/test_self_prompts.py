"""Self-generated ("Magpie") prompts: the user turn's place in a chat template, the filter (length, duplicates,
benchmark text), and generation on a tiny model that ends its turns."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from specd.errors import InvalidParameterError
from specd.model.tokenizer import Tokenizer
from specd.testing import byte_tokenizer, tiny_hf_config_dict, tiny_specd_model
from specd.training.overlap import ReservedText, benchmark_texts
from specd.training.self_prompts import (
    DROP_REASONS,
    PromptFilter,
    SelfPromptConfig,
    generate_self_prompts,
    user_turn,
)

NEWLINE = 3 + ord("\n")  # the byte tokenizer's id of "\n", which ends a user turn in its chat template
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class EndsTurns:
    """The tiny target with a bonus on the newline's logit, so that its sampled user turns end (a random model
    almost never emits the one token that ends a turn)."""

    def __init__(self, target: Any, bonus: float = 3.0) -> None:
        self._target = target
        self._bonus = bonus

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def __call__(self, batch: Any, cache: Any, num_layers: int | None = None) -> torch.Tensor:
        logits = self._target(batch, cache, num_layers)  # [rows, vocab]
        return logits + self._bonus * (torch.arange(logits.shape[-1]) == NEWLINE)


@pytest.fixture(scope="module")
def ends_turns() -> EndsTurns:
    return EndsTurns(tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32))


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tokenizer.backend, eos_token_ids=(2,), bos_token_id=1, chat_template=template,
                     special_tokens=dict(tokenizer.special_tokens))


def test_user_turn_is_the_template_text_around_a_users_message() -> None:
    tokenizer = byte_tokenizer(320)
    assert user_turn(tokenizer) == ("<|user|>", "\n")
    smol = user_turn(_with_template(tokenizer, SMOL_TEMPLATE))
    assert smol.prefix == "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n"
    assert smol.end == "<|im_end|>"
    with pytest.raises(InvalidParameterError, match="--self-prompts"):
        user_turn(_with_template(tokenizer, None))
    with pytest.raises(InvalidParameterError, match="--self-prompts"):  # the content is rewritten: no anchor
        user_turn(_with_template(tokenizer, "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"))


def test_filter_drops_unfinished_short_long_duplicate_and_reserved_prompts() -> None:
    config = SelfPromptConfig(count=10, min_words=3, max_words=12)
    reserved = ReservedText(["Why do we have seasons on Earth?",
                             "Summarize this in two sentences:\n\nThe town library opened a repair cafe."])
    judge = PromptFilter(config, existing=["What is a prime number?"], reserved=reserved)
    verdicts = [
        judge.judge("How do I grow tomatoes on a balcony?", finished=True, has_control_tokens=False),
        judge.judge("how do I grow TOMATOES on a balcony", finished=True, has_control_tokens=False),  # same words
        judge.judge("What is a prime number", finished=True, has_control_tokens=False),  # in the given set
        judge.judge("Tell me a joke about cats and dogs", finished=False, has_control_tokens=False),
        judge.judge("Hi there", finished=True, has_control_tokens=False),
        judge.judge(" ".join(["word"] * 13), finished=True, has_control_tokens=False),
        judge.judge("Write a poem about the sea please", finished=True, has_control_tokens=True),
        judge.judge("My teacher asked: why do we have seasons on Earth? Explain.", finished=True,
                    has_control_tokens=False),  # a short benchmark line inside
        judge.judge("Please: the town library opened a repair cafe on Sunday.", finished=True,
                    has_control_tokens=False),  # an 8-word run of a benchmark text
        judge.judge("Which seasons do we have in Japan?", finished=True, has_control_tokens=False),
    ]
    assert verdicts == [None, "duplicate", "duplicate", "unfinished", "length", "length", "control", "reserved",
                        "reserved", None]
    assert judge.dropped == {"unfinished": 1, "control": 1, "length": 2, "duplicate": 2, "reserved": 2}


def test_benchmark_texts_are_found_and_reserved() -> None:
    texts = benchmark_texts()
    assert len(texts) >= 36  # four kinds of at least eight prompts, and the extraction prompts
    reserved = ReservedText(texts)
    assert reserved.num_texts == len(texts)
    assert reserved.overlaps("Could you explain how a rainbow forms, in detail?")  # bench chat, 5 words
    assert not reserved.overlaps("Explain how a glacier forms.")


def test_self_prompts_are_generated_filtered_deterministic_and_extend(ends_turns: EndsTurns) -> None:
    tokenizer = byte_tokenizer(320)
    config = SelfPromptConfig(count=6, max_tokens=24, min_words=1, batch_size=8, seed=3)
    made = generate_self_prompts(ends_turns, tokenizer, config, existing=[], reserved=ReservedText([]))
    assert len(made.texts) == 6
    assert made.num_candidates == 6 + sum(made.dropped.values())
    assert set(made.dropped) == set(DROP_REASONS)
    assert made.dropped["unfinished"] > 0  # some turns ran into max_tokens and were dropped
    assert all(text and "\n" not in text for text in made.texts)  # each is one user turn, without its end
    again = PromptFilter(config, existing=[], reserved=ReservedText([]))
    assert all(again.judge(text, True, False) is None for text in made.texts)  # no two are duplicates
    assert generate_self_prompts(ends_turns, tokenizer, config) == made
    fewer = generate_self_prompts(ends_turns, tokenizer, SelfPromptConfig(count=3, max_tokens=24, min_words=1,
                                                                          batch_size=8, seed=3))
    assert fewer.texts == made.texts[:3]
    # A prompt already in the set is never made again.
    without_first = generate_self_prompts(ends_turns, tokenizer, config, existing=[made.texts[0]])
    assert made.texts[0] not in without_first.texts
    assert without_first.dropped["duplicate"] >= 1


def test_a_model_that_never_ends_its_turns_is_refused_by_the_budget() -> None:
    tokenizer = byte_tokenizer(320)
    target = EndsTurns(tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32), bonus=-100.0)
    made = generate_self_prompts(target, tokenizer, SelfPromptConfig(count=2, max_tokens=8, batch_size=4,
                                                                     max_candidates_per_prompt=2))
    assert made.texts == [] and made.num_candidates == 4 and made.dropped["unfinished"] == 4


@pytest.mark.parametrize(("field", "value", "name"), [
    ("count", -1, "--self-prompts"), ("max_tokens", 0, "self_prompts.max_tokens"),
    ("temperature", 0.0, "self_prompts.temperature"), ("max_words", 2, "self_prompts.max_words"),
])
def test_bad_config_names_the_field(field: str, value: object, name: str) -> None:
    kwargs: dict[str, Any] = {"count": 1, field: value}
    with pytest.raises(InvalidParameterError, match=name):
        SelfPromptConfig(**kwargs)


def test_train_draft_answers_the_self_prompts_and_keeps_them_with_the_cache(ends_turns: EndsTurns, tmp_path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from specd.training import run as run_module
    from specd.training.data import load_samples
    from specd.training.run import DataConfig, self_prompts_file, train_draft
    from specd.training.split import default_prompt_set
    from specd.training.trainer import TrainConfig

    tokenizer = byte_tokenizer(320)
    data = DataConfig(max_tokens=8, batch_size=8, draft_vocab_size=64, max_prompts=6, self_prompts=4,
                      held_out_fraction=0.25, held_out_templates=0.0)
    cache = tmp_path / "data.pt"
    result = train_draft(ends_turns, tokenizer, "tiny", tmp_path / "head", default_prompt_set(), data,
                         TrainConfig(epochs=1, batch_tokens=256), data_cache=cache)
    assert result is not None
    saved = self_prompts_file(cache)
    texts = json.loads(saved.read_text())["prompts"]
    assert len(texts) == 4 and len(set(texts)) == 4
    report = result.report
    assert report["data"]["prompts"] == 10
    assert report["self_prompts"]["count"] == 4
    assert report["self_prompts"]["reserved_texts"] >= 36  # checked against the benchmark prompts
    # The answer-generation phase answered them: answers 6..9 continue exactly the self-generated prompts.
    samples = load_samples(cache, 10)
    by_prompt = {s.prompt_index: s for s in samples}
    assert set(by_prompt) == set(range(10))
    for number, text in enumerate(texts):
        sample = by_prompt[6 + number]
        assert sample.token_ids[: sample.num_prompt_tokens].tolist() == tokenizer.encode_chat(
            [{"role": "user", "content": text}])
    # One self-generated prompt is held out (25% of 4) and measured on its own.
    assert report["data"]["held_out_self_prompts"] == 1
    assert report["held_out_sets"]["self"]["prompts"] == 1
    # A second run reuses the saved prompts (no generation), even when it only trains.
    monkeypatch.setattr(run_module, "generate_self_prompts", lambda *a, **k: pytest.fail("generated again"))
    again = train_draft(ends_turns, tokenizer, "tiny", tmp_path / "head2", default_prompt_set(), data,
                        TrainConfig(epochs=1, batch_tokens=256), data_cache=cache, generate=False)
    assert again is not None and again.report["data"]["train_tokens"] == report["data"]["train_tokens"]
    saved.unlink()
    with pytest.raises(InvalidParameterError, match="--self-prompts"):
        train_draft(ends_turns, tokenizer, "tiny", tmp_path / "head3", default_prompt_set(), data, TrainConfig(),
                    data_cache=cache, generate=False)
