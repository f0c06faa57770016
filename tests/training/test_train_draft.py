"""`specd train-draft`: bad arguments exit 2 naming the flag (before any model is loaded), and the pipeline on a
tiny model writes a head that loads back, a report, and a config naming its target."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specd import cli
from specd.errors import InvalidParameterError
from specd.model.draft_head import DraftHead, target_fingerprint
from specd.training import run as run_module
from specd.training.data import Sample, load_samples
from specd.training.run import DataConfig, default_conversations, train_draft
from specd.training.split import PromptSet, default_prompt_set, file_prompt_set, split_prompts
from specd.training.trainer import TrainConfig


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded although the arguments are invalid")

    monkeypatch.setattr("specd.model.loader.load_checkpoint", refuse)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--epochs", "0"], "--epochs"),
        (["--depth", "0"], "--depth"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--held-out", "1.5"], "--held-out"),
        (["--temperature", "0"], "--temperature"),
        (["--samples-per-prompt", "0"], "--samples-per-prompt"),
        (["--draft-vocab-size", "0"], "--draft-vocab-size"),
        (["--max-prompts", "1"], "--max-prompts"),
        (["--held-out-templates", "1"], "--held-out-templates"),
        (["--held-out-templates", "-0.1"], "--held-out-templates"),
        (["--self-prompts", "-1"], "--self-prompts"),
        (["--init-from", "/nonexistent/head"], "--init-from"),
        (["--generate-minutes", "-1"], "--generate-minutes"),
        (["--train-minutes", "-1"], "--train-minutes"),
        (["--threads", "0"], "--threads"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "--prompts"),
    ],
)
def test_bad_argument_exits_2_naming_the_flag(capsys, tmp_path, no_model_load, argv: list[str], flag: str) -> None:
    code = cli.main(["train-draft", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"specd: error: {flag}:" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--out"),
        (["--out", "x", "--only", "train"], "--only"),
        (["--only", "generate"], "--only"),
    ],
)
def test_missing_out_or_cache_exits_2_naming_the_flag(capsys, no_model_load, argv: list[str], flag: str) -> None:
    assert cli.main(["train-draft", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_pipeline_on_a_tiny_model_writes_a_loadable_head(tmp_path, tokenizer, monkeypatch) -> None:
    from specd.testing import tiny_hf_config_dict, tiny_specd_model

    target = tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32)
    data = DataConfig(max_tokens=16, batch_size=4, draft_vocab_size=64, held_out_fraction=0.25, max_prompts=8)
    result = train_draft(target, tokenizer, "tiny", tmp_path / "head", default_conversations(), data,
                         TrainConfig(epochs=2, batch_tokens=256), command="specd train-draft --test",
                         data_cache=tmp_path / "data.pt")
    files = {p.name for p in (tmp_path / "head").iterdir()}
    assert {"head.safetensors", "config.json", "report.json"} <= files
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["target_fingerprint"] == target_fingerprint(target)
    assert config["training"]["command"] == "specd train-draft --test"
    report = json.loads((tmp_path / "head" / "report.json").read_text())
    assert result is not None
    assert report["data"]["prompts"] == 8 and report["data"]["held_out_prompts"] == 2
    assert len(report["held_out_acceptance_per_position"]) == 6
    assert report["loss_curve"]["steps"] == list(range(1, report["training"]["steps"] + 1))
    loaded = DraftHead.load(tmp_path / "head", target)
    assert torch.equal(loaded.token_map, result.head.token_map)
    # The cached data is reused: a second run generates nothing and trains on the same sequences.
    generated: list[int] = []
    real_generate = run_module.generate_samples

    def counting(*args: object, **kwargs: object) -> list[Sample]:
        out = real_generate(*args, **kwargs)  # type: ignore[arg-type]
        generated.append(len(out))
        return out

    monkeypatch.setattr(run_module, "generate_samples", counting)
    again = train_draft(target, tokenizer, "tiny", tmp_path / "head2", default_conversations(), data,
                        TrainConfig(epochs=1, batch_tokens=256), data_cache=tmp_path / "data.pt")
    assert generated == [0]
    assert again is not None and again.report["data"]["train_tokens"] == report["data"]["train_tokens"]
    # A third answer per prompt: only those answers are generated, appended to the file, then trained on.
    more = DataConfig(max_tokens=16, batch_size=4, draft_vocab_size=64, held_out_fraction=0.25, max_prompts=8,
                      samples_per_prompt=3)
    assert train_draft(target, tokenizer, "tiny", None, default_conversations(), more, TrainConfig(),
                       data_cache=tmp_path / "data.pt", train_head=False) is None
    assert generated == [0, 8]
    assert len(load_samples(tmp_path / "data.pt", 8)) == 24
    with pytest.raises(InvalidParameterError, match="--data-cache"):
        train_draft(target, tokenizer, "tiny", tmp_path / "h3", default_conversations(), data, TrainConfig(),
                    data_cache=tmp_path / "missing.pt", generate=False)
    # Answers filed under other prompts (the list was reordered) are refused, not trained on.
    with pytest.raises(InvalidParameterError, match="holds answers to other prompts"):
        train_draft(target, tokenizer, "tiny", tmp_path / "h4", default_conversations()[::-1], data, TrainConfig(),
                    data_cache=tmp_path / "data.pt", generate=False)


def test_split_holds_out_random_prompts_and_whole_templates() -> None:
    prompt_set = default_prompt_set()
    split = split_prompts(prompt_set, 0.05, 0.1, 0)
    # The random share is the one earlier heads were measured on: the first 5% of a seeded shuffle.
    order = list(range(len(prompt_set.conversations)))
    random.Random(0).shuffle(order)
    assert split.prompts == set(order[:22])
    # One template of each kind that has several (qa questions stand alone), every one of its prompts held out.
    assert sorted(name.split("/")[0] for name in split.template_names) == ["chat", "code", "edit", "summarise",
                                                                           "writing"]
    for index, template in enumerate(prompt_set.templates):
        if template in split.template_names:
            assert index in split.prompts | split.templates
    assert not split.prompts & split.templates
    assert all(prompt_set.templates[i] in split.template_names for i in split.templates)
    assert split.self == set()
    # Self-generated prompts appended later change neither set; a share of them is held out on its own.
    grown = PromptSet(prompt_set.conversations + [[{"role": "user", "content": f"q{i}"}] for i in range(40)],
                      prompt_set.kinds + ["self"] * 40, prompt_set.templates + [None] * 40)
    grown_split = split_prompts(grown, 0.05, 0.1, 0)
    assert grown_split.prompts == split.prompts and grown_split.templates == split.templates
    assert len(grown_split.self) == 2 and min(grown_split.self) >= len(prompt_set.conversations)
    assert split_prompts(prompt_set, 0.05, 0.0, 0).templates == set()
    more = split_prompts(prompt_set, 0.05, 0.5, 0)
    assert len(more.template_names) == 6 + 4 + 2 + 2 + 2  # half of 11 chat, 8 writing, 4 code/summarise/edit


def test_report_measures_the_held_out_templates_apart(tmp_path, tokenizer) -> None:
    from specd.testing import tiny_hf_config_dict, tiny_specd_model

    target = tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32)
    data = DataConfig(max_tokens=8, batch_size=8, draft_vocab_size=64, max_prompts=24, samples_per_prompt=1)
    result = train_draft(target, tokenizer, "tiny", tmp_path / "head", default_prompt_set(), data,
                         TrainConfig(epochs=1, batch_tokens=256))
    assert result is not None
    report = result.report
    split = split_prompts(PromptSet(*(column[:24] for column in default_prompt_set())), data.held_out_fraction,
                          data.held_out_templates, data.seed)
    templates = report["held_out_sets"]["templates"]
    assert templates["names"] == split.template_names and templates["prompts"] == len(split.templates) > 0
    assert templates["answers"] == len(split.templates)  # one greedy answer each
    assert len(templates["acceptance_per_position"]) == 6 and set(templates["tau"]) == {"k=1", "k=2", "k=4", "k=6"}
    assert report["held_out_sets"]["prompts"]["acceptance_per_position"] == report["held_out_acceptance_per_position"]
    assert report["data"]["held_out_template_prompts"] == len(split.templates)
    # Nothing held out reached training: the trained answers are exactly the other prompts'.
    held_out = split.prompts | split.templates
    assert report["data"]["train_tokens"] == sum(
        len(tokenizer.encode_chat(c)) + 8 - 1 for i, c in enumerate(default_prompt_set().conversations[:24])
        if i not in held_out)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["training"]["held_out_tau_templates"] == templates["tau"]


def test_init_from_goes_on_training_a_saved_head(tmp_path, tokenizer) -> None:
    from specd.testing import tiny_hf_config_dict, tiny_specd_model
    from specd.training.run import evaluate

    target = tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32)
    data = DataConfig(max_tokens=12, batch_size=8, draft_vocab_size=64, held_out_fraction=0.25, max_prompts=8)
    cache = tmp_path / "data.pt"
    first = train_draft(target, tokenizer, "tiny", tmp_path / "a", default_conversations(), data,
                        TrainConfig(epochs=2, batch_tokens=256), command="first", data_cache=cache)
    assert first is not None
    saved = DraftHead.load(tmp_path / "a", target)
    # A different draft vocabulary size is ignored: the saved head's own vocabulary is kept.
    wider = DataConfig(max_tokens=12, batch_size=8, draft_vocab_size=96, held_out_fraction=0.25, max_prompts=8)
    second = train_draft(target, tokenizer, "tiny", tmp_path / "b", default_conversations(), wider,
                         TrainConfig(epochs=1, batch_tokens=256), command="second", data_cache=cache,
                         generate=False, init_from=tmp_path / "a")
    assert second is not None
    assert torch.equal(second.head.token_map, saved.token_map)
    # Before training, the second run measures exactly the saved head on the held-out answers.
    held_out = split_prompts(file_prompt_set(default_conversations()[:8]), 0.25, 0.1, 0).prompts
    samples = [s for s in load_samples(cache, 8) if s.prompt_index in held_out]
    assert second.report["held_out_acceptance_per_position_untrained"] == evaluate(saved, samples)[
        "acceptance_per_position"]
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["training"]["command"] == "second" and config["training"]["continues"]["command"] == "first"
    assert second.report["init_from"] == str(tmp_path / "a")
    with pytest.raises(InvalidParameterError, match="--init-from"):
        train_draft(target, tokenizer, "tiny", tmp_path / "c", default_conversations(), data, TrainConfig(),
                    data_cache=cache, generate=False, init_from=tmp_path)
