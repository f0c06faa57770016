"""bench/spec.py's extract kind: every prompt has its schema, and forced tokens are counted by replaying the grammar."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prompts import EXTRACT_KIND, EXTRACT_SCHEMAS, prompts_of
from spec import extract_constraints, forced_counts
from specd.sampling.params import StructuredOutput
from specd.testing import byte_tokenizer


def test_every_extract_prompt_has_its_schema() -> None:
    names = [p.name for p in prompts_of(EXTRACT_KIND)]
    assert names and set(names) == set(EXTRACT_SCHEMAS)
    assert [c.value for c in extract_constraints(2)] == [EXTRACT_SCHEMAS[n] for n in names[:2]]


def test_forced_counts_replays_the_grammar() -> None:
    tokenizer = byte_tokenizer(320)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text = json.dumps({"ok": True})  # {"ok": true}: only 't' is chosen; every other byte is forced
    tokens = tokenizer.encode(text)[1:]  # without <bos>
    constraint = StructuredOutput("json_schema", schema)
    forced, total = forced_counts(tokenizer, 320, [[*tokens, 2]], [constraint])
    assert total == len(text) and forced == len(text) - 1
