"""Grammar state for structured outputs: draft validation, per-row masks, rollback-free queries, forced tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specd.errors import InvalidParameterError
from specd.model.tokenizer import Tokenizer
from specd.sampling.grammar import GrammarCompiler, apply_masks
from specd.testing import byte_tokenizer

VOCAB = 320
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend_json(), VOCAB, tokenizer.eos_token_ids)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_drafts_are_validated_and_masks_follow_each_row_without_changing_state(compiler, tokenizer):
    grammar = compiler.json_schema(SCHEMA)
    good = _ids(tokenizer, '{"name": "Al", "age": 3}')
    assert grammar.valid_prefix(good) == len(good)
    bad = _ids(tokenizer, '{"nope": 1}')
    assert grammar.valid_prefix(bad) == 3  # '{', '"' and 'n' (of "name") are fine; 'o' is not
    masks = grammar.row_masks(good[:5])
    assert masks.shape == (6, VOCAB) and masks.dtype == torch.bool
    for row, token in enumerate(good[:5]):
        assert masks[row, token]  # each next token of the valid text is allowed at its row
    assert not masks[0, _ids(tokenizer, "x")[0]]  # a JSON object cannot start with 'x'
    assert not masks[0, EOS]  # nor end before it starts
    assert grammar.valid_prefix(good) == len(good)  # the queries left the state where it was
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        grammar.row_masks(bad)
    assert grammar.valid_prefix(good) == len(good)  # a refused draft is rolled back too


def test_advance_commits_and_the_grammar_finishes_on_eos(compiler, tokenizer):
    grammar = compiler.json_schema(SCHEMA)
    text = _ids(tokenizer, '{"name": "Al", "age": 3}')
    grammar.advance(text[:4])
    assert grammar.valid_prefix(text[4:]) == len(text) - 4
    assert not grammar.finished
    grammar.advance(text[4:])
    assert grammar.finished  # the object is closed: nothing but end-of-sequence may follow
    assert torch.nonzero(grammar.row_masks([])[0]).squeeze(1).tolist() == [EOS]
    with pytest.raises(ValueError, match="refused"):
        compiler.json_schema(SCHEMA).advance(_ids(tokenizer, "hello"))


def test_forced_tokens_are_what_the_grammar_allows_alone(compiler, tokenizer):
    grammar = compiler.json_schema({"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"], "additionalProperties": False})
    grammar.advance(_ids(tokenizer, "{"))
    assert tokenizer.decode(grammar.forced_tokens()) == '"city": "'
    grammar.advance(_ids(tokenizer, '"city": "Oslo'))
    assert tokenizer.decode(grammar.forced_tokens()) == ""  # the string may go on, or close
    grammar.advance(_ids(tokenizer, '"'))
    assert tokenizer.decode(grammar.forced_tokens()) == "}"


def test_random_walks_under_the_masks_always_give_schema_valid_json(compiler, tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        grammar = compiler.json_schema(SCHEMA)
        out: list[int] = []
        while not grammar.finished and len(out) < 200:
            allowed = torch.nonzero(grammar.row_masks([])[0]).squeeze(1).tolist()
            token = rng.choice(allowed)
            grammar.advance([token])
            out.append(token)
        assert grammar.finished
        value = json.loads(tokenizer.decode(out))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 8


def test_masked_logits_never_pick_a_forbidden_token(compiler, tokenizer):
    grammar = compiler.json_schema(SCHEMA)
    masks = grammar.row_masks([])
    logits = torch.zeros(3, VOCAB)
    logits[1, _ids(tokenizer, "x")[0]] = 50.0  # the model loves a forbidden token
    out = apply_masks(logits, [(1, masks)])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert masks[0, int(out[1].argmax())]
    assert torch.isinf(out[1]).sum() == VOCAB - int(masks.sum())
    assert apply_masks(logits, []) is logits


def test_other_constraints_and_bad_grammars(compiler, tokenizer):
    choice = compiler.choice(["yes", "no"])
    assert choice.valid_prefix(_ids(tokenizer, "no")) == 2 and choice.valid_prefix(_ids(tokenizer, "maybe")) == 0
    digits = compiler.regex(r"[0-9]{3}")
    assert digits.valid_prefix(_ids(tokenizer, "12a")) == 2
    assert compiler.json_schema(True).valid_prefix(_ids(tokenizer, '{"any": [1, 2]}')) == 15
    assert compiler.json_schema(True).valid_prefix(_ids(tokenizer, '{"any":1}')) == 7  # one layout: ": " only
    with pytest.raises(InvalidParameterError) as info:
        compiler.json_schema({"type": "no-such-type"})
    assert info.value.field == "response_format.json_schema.schema"
    with pytest.raises(InvalidParameterError) as info:
        compiler.choice([])
    assert info.value.field == "guided_choice"
    with pytest.raises(InvalidParameterError) as info:
        compiler.lark("start: (", field="guided_grammar")
    assert info.value.field == "guided_grammar"
