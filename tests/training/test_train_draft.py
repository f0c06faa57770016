"""`specd train-draft`: bad arguments exit 2 naming the flag (before any model is loaded), and the pipeline on a
tiny model writes a head that loads back, a report, and a config naming its target."""

from __future__ import annotations

import json

import pytest
import torch

from specd import cli
from specd.errors import InvalidParameterError
from specd.model.draft_head import DraftHead, target_fingerprint
from specd.training import run as run_module
from specd.training.data import Sample, load_samples
from specd.training.run import DataConfig, default_conversations, train_draft
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
