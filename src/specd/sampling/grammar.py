"""Grammar-constrained decoding (structured outputs) on llguidance, shaped for speculation.

A `Grammar` follows one request's committed output. Per verification step it answers, without changing its
state: how many of a draft it accepts (`valid_prefix`), and the token masks of the rows [last, d_1..d_k]
(`row_masks`: row j is what may follow the committed output plus d_1..d_j). After verification the engine
`advance`s it by the tokens it emitted. `forced_tokens` are the tokens the grammar allows alone from here
(JSON punctuation, a schema's key names): a draft of them is certain to be accepted by the grammar.

Why llguidance: measured on the default model's 49,152-token vocabulary (JSON schema with a string, an integer
and a string array), one mask costs ~0.1 ms on this 2-core CPU (xgrammar 0.2.9: ~0.02 ms) against a 12-30 ms
decode step, so either is negligible; llguidance is a 3 MB wheel with no dependencies, while xgrammar pins torch,
transformers and triton. Both roll back and both validate a draft in one call.

Lossless use under speculation: masking p at every verified row is exactly what plain constrained decoding
samples from. A deterministic draft token the grammar forbids has p = 0 and would be rejected anyway, so cutting
the draft there changes nothing but the cost. A *sampled* draft must not be cut by its value (that biases the
output: the confidence policy once did): model-based proposers mask their q instead, so they never
sample a forbidden token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specd.errors import InvalidParameterError

# JSON laid out as Python's json.dumps writes it (", " and ": ", no other whitespace): one layout means the keys,
# quotes and separators between values are forced tokens, which can be drafted for free, and it is the layout
# small models imitate best. (llguidance's default allows any whitespace anywhere, so nothing is ever forced.)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of specd; only a broken install lands here
        raise InvalidParameterError("response_format", "structured outputs need llguidance (pip install llguidance)")\
            from exc
    return llguidance


class GrammarCompiler:
    """One per tokenizer: llguidance's view of the vocabulary (built once, ~0.5 s) and grammar construction.

    vocab_size: the model's (its logits' width). Ids the tokenizer does not define are never allowed.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        llguidance = _llguidance()
        if not eos_token_ids:
            raise ValueError("eos_token_ids: a grammar needs an end-of-sequence token to finish on")
        self.vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    def json_schema(
        self, schema: Mapping[str, Any] | bool, field: str = "response_format.json_schema.schema"
    ) -> Grammar:
        """Output must be JSON valid against `schema` (True: any JSON object, as json_object mode)."""
        llguidance = _llguidance()
        source = {"type": "object"} if schema is True else schema
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(source), overrides=JSON_LAYOUT)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidParameterError(field, f"is not a usable JSON schema: {exc}") from exc
        return self._matcher(grammar, field)

    def regex(self, pattern: str, field: str = "guided_regex") -> Grammar:
        return self._matcher(_llguidance().LLMatcher.grammar_from_regex(pattern), field)

    def lark(self, grammar: str, field: str = "guided_grammar") -> Grammar:
        return self._matcher(_llguidance().LLMatcher.grammar_from_lark(grammar), field)

    def choice(self, choices: Sequence[str], field: str = "guided_choice") -> Grammar:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidParameterError(field, "must be a non-empty list of non-empty strings")
        alternatives = " | ".join(json.dumps(c) for c in choices)
        return self.lark(f"start: {alternatives}", field)

    def _matcher(self, grammar: str, field: str) -> Grammar:
        llguidance = _llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise InvalidParameterError(field, f"grammar error: {messages[0] if messages else 'invalid'}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(field, f"grammar error: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size, self._eos_token_ids)


class Grammar:
    """One request's grammar state: the committed output so far. Not thread-safe (the engine thread owns it)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    @property
    def finished(self) -> bool:
        """The grammar has stopped: it can take no more tokens but end-of-sequence (or it took that)."""
        return bool(self._matcher.is_stopped())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from the committed state (state unchanged)."""
        if not tokens:
            return 0
        return int(self._matcher.validate_tokens(list(tokens)))

    def row_masks(self, draft: Sequence[int]) -> Tensor:  # [len(draft) + 1, vocab_size] bool
        """Allowed tokens after the committed output plus draft[:j], for j = 0..len(draft) (state unchanged).

        Assumes `draft` is a valid prefix (see valid_prefix); raises ValueError otherwise.
        """
        # Checked first: a refused token would put the matcher in an error state that rollback cannot undo.
        if self.valid_prefix(draft) < len(draft):
            raise ValueError(f"draft {list(draft)} is not allowed by the grammar")
        masks = [self._mask()]
        for token in draft:
            self._matcher.consume_token(int(token))
            masks.append(self._mask())
        if draft:
            self._matcher.rollback(len(draft))
        return torch.stack(masks)

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit emitted tokens. Raises ValueError if the grammar refuses one (a bug upstream: masks forbid it).

        End-of-sequence after a complete output is accepted as is: a stopped matcher has nothing left to consume.
        """
        tokens = [int(t) for t in tokens]
        while tokens and self.finished and tokens[0] in self.eos_token_ids:
            tokens = tokens[1:]
        if tokens and not self._matcher.consume_tokens(tokens):
            raise ValueError(f"the grammar refused committed tokens {tokens}: {self._matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows alone from the committed state, in order (may be empty)."""
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def _mask(self) -> Tensor:  # [vocab_size] bool
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))


def apply_masks(
    logits: Tensor,  # [num_rows, vocab_size]
    masks: Sequence[tuple[int, Tensor]],  # (first row, [rows, vocab_size] bool) per constrained sequence
) -> Tensor:  # [num_rows, vocab_size] float32; `logits` itself when there is nothing to mask
    """Forbidden tokens get -inf: they have probability 0 and can never be the argmax (a row always allows at least
    end-of-sequence, so no row is all -inf)."""
    if not masks:
        return logits
    out = logits.float().clone()
    for first, mask in masks:
        rows = out[first : first + mask.shape[0]]
        if mask.shape[1] != rows.shape[1]:
            raise ValueError(f"a grammar mask has {mask.shape[1]} tokens for logits over {rows.shape[1]}")
        rows.masked_fill_(~mask.to(rows.device), float("-inf"))
    return out
