"""Sequence stop rules in isolation: tokens whose text is long, as real tokenizers produce."""

from specd.engine.sequence import Sequence
from specd.sampling.params import SamplingParams


class _WordDetokenizer:
    """Each token id decodes to a fixed string (no byte merging)."""

    def __init__(self, words: dict[int, str]) -> None:
        self.words = words

    def push(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids)

    def flush(self) -> str:
        return ""


def _seq(params: SamplingParams, words: dict[int, str]) -> Sequence:
    return Sequence(
        request_id="r", seq_id=0, prompt=None, prompt_token_ids=[0], params=params, generator=None,
        arrival_time=0.0, k_max=0, k_policy=None,
        detokenizer=_WordDetokenizer(words), eos_token_ids=frozenset(), max_model_len=1000,  # type: ignore[arg-type]
    )


def test_stop_string_at_start_of_a_long_token_is_found():
    # One token adds 40 characters; the stop string sits at its start, far from the end of the text.
    words = {1: "ab", 2: "STOP" + " " * 36, 3: "cd"}
    seq = _seq(SamplingParams(max_tokens=10, stop=["STOP"]), words)
    kept = seq.append_tokens([1, 2, 3], None)
    assert kept == 2 and seq.finish_reason == "stop"
    assert seq.text == "ab"


def test_stop_string_straddling_into_a_long_token_is_found():
    words = {1: "xxST", 2: "OP" + "y" * 30, 3: "cd"}
    seq = _seq(SamplingParams(max_tokens=10, stop=["STOP"], include_stop_str_in_output=True), words)
    assert seq.append_tokens([1, 2, 3], None) == 2
    assert seq.finish_reason == "stop" and seq.text == "xxSTOP"
