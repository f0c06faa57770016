"""Training a head: the unrolled mask, a few steps lower the loss, and the held-out acceptance count."""

from __future__ import annotations

import itertools

import pytest
import torch

from specd.errors import InvalidParameterError
from specd.model.draft_head import DraftHead
from specd.training.data import Sample
from specd.training.trainer import (
    TrainConfig,
    acceptance,
    loss_of,
    make_batch,
    mean_acceptance_length,
    train,
    unrolled_mask,
)


def test_unrolled_mask_reads_the_committed_prefix_and_the_own_chain() -> None:
    mask = unrolled_mask(5, 3)  # [5, 15]: depth-1 keys, depth-2 keys, depth-3 keys
    row = 4  # chain: committed rows 0..2, then depth 2 at row 3 and depth 3 at row 4
    assert mask[row, :5].tolist() == [True, True, True, False, False]
    assert mask[row, 5:10].tolist() == [False, False, False, True, False]
    assert mask[row, 10:].tolist() == [False, False, False, False, True]
    assert torch.equal(unrolled_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())


def _samples(target, count: int, length: int, seed: int) -> list[Sample]:
    """Sequences the tiny target wrote greedily, with its features (a cheap stand-in for generate_samples)."""
    from specd.model.attention import ForwardBatch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        ids = torch.randint(3, 320, (4,), generator=generator).tolist()
        cache = target.make_cache(1, 64)
        cache.reserve(64)
        slot = cache.allocate()
        for _ in range(length):
            step = target(ForwardBatch.build([ids], [slot], [0], [[len(ids) - 1]]), cache)
            ids.append(int(step.argmax(-1)))
        run = target.forward_with_hidden(ForwardBatch.build([ids[:-1]], [slot], [0], [[len(ids) - 2]]), cache,
                                         hidden_layers=(-1,))
        assert run.hidden_states is not None
        out.append(Sample(index, torch.tensor(ids[:-1]), 4, run.hidden_states.to(torch.bfloat16), True))
    return out


@pytest.fixture(scope="module")
def target32():
    from specd.testing import tiny_hf_config_dict, tiny_specd_model

    return tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float32)


def test_a_few_steps_lower_the_loss_and_raise_training_acceptance(target32) -> None:
    train_set = _samples(target32, 12, 24, seed=0)
    held_out = _samples(target32, 4, 24, seed=1)
    head = DraftHead.initialise(target32, torch.arange(320), "tiny")
    config = TrainConfig(epochs=12, batch_tokens=256, learning_rate=3e-3, depth=2)
    before_loss = loss_of(head, make_batch(train_set), config).total.item()
    before = acceptance(head, train_set, 3)
    history = train(head, train_set, held_out, config)
    after_loss = loss_of(head, make_batch(train_set), config).total.item()
    after = acceptance(head, train_set, 3)
    assert after_loss < 0.92 * before_loss  # the loss includes the target entropy, which no head removes
    # A random tiny target generalises little, but the held-out loss must still go down.
    assert history.held_out_loss[-1][1] < history.held_out_loss[0][1]
    assert mean_acceptance_length(after, 3) > mean_acceptance_length(before, 3)
    assert all(a >= b for a, b in itertools.pairwise(after))  # accepting j + 1 tokens needs the first j


def test_acceptance_counts_chains_by_hand(target32) -> None:
    """With a head that always predicts the sequence's next token (a map whose only row is that token) the
    acceptance is 1 at every position; with the wrong token it is 0."""
    sample = _samples(target32, 1, 10, seed=3)[0]
    response = sample.token_ids[sample.num_prompt_tokens - 1 :].tolist()
    constant = response[1]
    if any(t != constant for t in response[1:]):
        wrong = DraftHead.initialise(target32, torch.tensor([(constant + 1) % 320]), "tiny")
        assert acceptance(wrong, [sample], 2) == [0.0, 0.0]
    right = DraftHead.initialise(target32, torch.tensor([constant]), "tiny")
    per_position = acceptance(right, [sample], 1)
    chains = len(sample.token_ids) - sample.num_prompt_tokens
    following = sample.token_ids[sample.num_prompt_tokens :].tolist()
    assert per_position == [following.count(constant) / chains]


@pytest.mark.parametrize(("field", "flag"), [("epochs", "--epochs"), ("depth", "--depth"),
                                             ("batch_tokens", "--batch-tokens")])
def test_bad_training_settings_name_the_flag(field: str, flag: str) -> None:
    with pytest.raises(InvalidParameterError, match=f"^{flag}:"):
        TrainConfig(**{field: 0})
