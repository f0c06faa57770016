"""Penalties and logit_bias: each verification row counts the drafts before it, exactly as plain decoding would."""

from __future__ import annotations

import pytest
import torch

from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams
from specd.sampling.penalties import TokenHistory, adjust_logits

VOCAB = 12


def _reference_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, the textbook way: bias, then presence/frequency on the output, then repetition on both."""
    row = logits.clone().double()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    for token in range(VOCAB):
        count = output.count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        if params.repetition_penalty != 1.0 and (token in prompt or token in output):
            penalty = params.repetition_penalty
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    return row.float()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=0.8, logit_bias={0: 2.0}),
    ],
)
def test_each_verification_row_counts_the_drafts_before_it(params):
    torch.manual_seed(0)
    prompt, output, drafts = [1, 2, 2, 9], [4, 4, 5], [5, 6, 4]
    logits = torch.randn(len(drafts) + 1, VOCAB) * 3
    adjusted = adjust_logits(logits, [params], [len(drafts) + 1], [TokenHistory(prompt, output)], [drafts])
    for row in range(len(drafts) + 1):
        expected = _reference_row(logits[row], params, prompt, output + drafts[:row])
        torch.testing.assert_close(adjusted[row], expected, rtol=1e-6, atol=1e-5)


def test_only_sequences_that_ask_are_changed_and_the_input_is_untouched():
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB)
    original = logits.clone()
    plain, biased = SamplingParams(), SamplingParams(logit_bias={2: 1.0})
    histories = [TokenHistory([1], [3]), TokenHistory([1], [3])]
    assert adjust_logits(logits, [plain, plain], [2, 3], histories, [[4], [4, 5]]) is logits
    out = adjust_logits(logits, [plain, biased], [2, 3], histories, [[4], [4, 5]])
    assert torch.equal(logits, original)
    assert torch.equal(out[:2], logits[:2])
    assert torch.equal(out[2:, 2], logits[2:, 2] + 1.0)


def test_neutral_values_are_no_ops_and_bad_values_name_the_field():
    logits = torch.zeros(1, VOCAB)
    neutral = SamplingParams(presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, logit_bias={})
    assert adjust_logits(logits, [neutral], [1], [TokenHistory([1], [])], [[]]) is logits
    bad = (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
           ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
           ({"logit_bias": {1: 101.0}}, "logit_bias[1]"), ({"logit_bias": [1, 2]}, "logit_bias"))
    for kwargs, field in bad:
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field
