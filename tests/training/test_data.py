"""Training data: features recorded while generating equal a prefill's; prompt files; the draft vocabulary."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specd.errors import InvalidParameterError
from specd.model.attention import ForwardBatch
from specd.training.data import frequent_tokens, generate_samples, load_samples, read_prompt_file, save_samples

CONVERSATIONS = [[{"role": "user", "content": text}] for text in ("alpha beta", "gamma", "delta epsilon zeta", "eta")]


@pytest.fixture(scope="module")
def samples(tiny_model, tokenizer):
    return generate_samples(tiny_model, tokenizer, CONVERSATIONS, samples_per_prompt=2, max_tokens=12,
                            temperature=0.9, batch_size=3, seed=0)


def test_features_recorded_while_generating_equal_a_prefill(samples, tiny_model, tokenizer) -> None:
    assert len(samples) == 2 * len(CONVERSATIONS)
    assert sorted(s.prompt_index for s in samples) == sorted(2 * list(range(len(CONVERSATIONS))))
    for sample in samples:
        ids = sample.token_ids.tolist()
        assert ids[: sample.num_prompt_tokens] == tokenizer.encode_chat(CONVERSATIONS[sample.prompt_index])
        cache = tiny_model.make_cache(1, 64)
        cache.reserve(64)
        slot = cache.allocate()
        out = tiny_model.forward_with_hidden(ForwardBatch.build([ids], [slot], [0], [[len(ids) - 1]]), cache,
                                             hidden_layers=(-1,))
        assert out.hidden_states is not None
        assert sample.features.shape == out.hidden_states.shape
        assert torch.equal(sample.features, out.hidden_states.to(torch.bfloat16))


def test_greedy_answers_are_the_targets_argmax(samples, tiny_model) -> None:
    for sample in (s for s in samples if s.greedy):
        logits = tiny_model.compute_logits(sample.features[sample.num_prompt_tokens - 1 : -1].double())
        # bfloat16 features: compare where the target's top choice is clear.
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.5
        predicted = logits.argmax(-1)[clear]
        assert torch.equal(predicted, sample.token_ids[sample.num_prompt_tokens :][clear])


def test_a_resumed_run_generates_only_the_missing_answers(samples, tiny_model, tokenizer) -> None:
    done = {(0, 0), (2, 1), (3, 0)}
    saved: list[list[tuple[int, int]]] = []
    rest = generate_samples(tiny_model, tokenizer, CONVERSATIONS, samples_per_prompt=2, max_tokens=12,
                            temperature=0.9, batch_size=3, seed=0, done=done,
                            checkpoint=lambda so_far: saved.append([s.job for s in so_far]), checkpoint_every_s=0.0)
    jobs = {(i, s) for i in range(len(CONVERSATIONS)) for s in range(2)}
    assert {s.job for s in rest} == jobs - done
    assert all(s.greedy == (s.sample == 0) for s in rest)
    # Checkpoints grow answer by answer and the last one is the result.
    assert saved[-1] == [s.job for s in rest]
    assert all(set(a) <= set(b) for a, b in itertools.pairwise(saved))
    # An answer depends on its prompt, sample number and seed only: the resumed run wrote what the full run did.
    full = {s.job: s.token_ids for s in samples}
    assert all(torch.equal(s.token_ids, full[s.job]) for s in rest)
    everything = generate_samples(tiny_model, tokenizer, CONVERSATIONS, samples_per_prompt=2, max_tokens=12,
                                  temperature=0.9, batch_size=3, seed=0, done=jobs)
    assert everything == []


def test_samples_round_trip_through_the_cache_file(tmp_path, samples) -> None:
    save_samples(tmp_path / "d.pt", samples)
    loaded = load_samples(tmp_path / "d.pt", len(CONVERSATIONS))
    assert all(torch.equal(a.features, b.features) and torch.equal(a.token_ids, b.token_ids) and a.job == b.job
               for a, b in zip(samples, loaded))
    # A file written before answers carried their sample number: every answer in it was a greedy one (sample 0).
    torch.save([tuple(s)[:5] for s in samples if s.greedy], tmp_path / "old.pt")
    assert {s.job for s in load_samples(tmp_path / "old.pt", len(CONVERSATIONS))} == {
        (i, 0) for i in range(len(CONVERSATIONS))}
    with pytest.raises(InvalidParameterError, match=r"--data-cache: .* other prompts"):
        load_samples(tmp_path / "d.pt", 1)
    (tmp_path / "bad.pt").write_text("nope")
    with pytest.raises(InvalidParameterError, match="--data-cache"):
        load_samples(tmp_path / "bad.pt", 4)


def test_prompt_file_formats_and_errors(tmp_path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text("\n".join([
        json.dumps("plain text"),
        json.dumps({"prompt": "as a field"}),
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
        "",
    ]))
    conversations = read_prompt_file(good)
    assert conversations[0] == [{"role": "user", "content": "plain text"}]
    assert conversations[2][0] == {"role": "system", "content": "be brief"}
    for content, message in [("{not json", ":1: not JSON"), (json.dumps({"x": 1}), ":1: expected"),
                             ("", "holds no prompts"), (json.dumps({"messages": []}), ":1: expected")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(content)
        with pytest.raises(InvalidParameterError, match=rf"--prompts: .*{message}"):
            read_prompt_file(bad)
    with pytest.raises(InvalidParameterError, match=r"--prompts: .* is not a file"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_draft_vocabulary_is_eos_then_most_frequent(samples) -> None:
    token_map = frequent_tokens(samples, 320, 16, always=[2])
    assert token_map.shape == (16,) and len(set(token_map.tolist())) == 16
    assert int(token_map[0]) == 2
    counts = torch.bincount(torch.tensor([t for s in samples for t in s.response_ids]), minlength=320)
    chosen = counts[token_map[1:]]
    others = counts[[t for t in range(320) if t not in set(token_map.tolist())]]
    assert int(chosen.min()) >= int(others.max())
