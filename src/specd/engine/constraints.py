"""Structured outputs inside the step: compile a request's constraint at admission, cut deterministic drafts at the
first token the grammar forbids, mask every verified row, advance the grammar by what was emitted.

Exactness: each verified row is masked to what may follow the committed output plus the drafts before it, which is
the distribution plain constrained decoding samples from. Only deterministic drafts are cut (a forbidden one has
p = 0 and would be rejected anyway); a sampled draft is never cut by its value, since that would bias the output.
A sampled draft that the grammar forbids is simply rejected by the verifier; rows after it are never reached, so
they are left unmasked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specd.engine.sequence import Sequence as Seq
from specd.engine.speculator import Drafts
from specd.errors import InvalidParameterError
from specd.model.tokenizer import Tokenizer
from specd.sampling.grammar import Grammar, GrammarCompiler, apply_masks
from specd.sampling.params import SamplingParams


class Constraints:
    """The engine's grammar compiler (built on first use: ~0.5 s for a 49k vocabulary) and the per-step glue."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None

    def compile(self, params: SamplingParams) -> Grammar | None:
        """The request's grammar, or None when it has no constraint. Raises InvalidParameterError naming the field."""
        spec = params.structured
        if spec is None:
            return None
        if self._tokenizer is None:
            raise InvalidParameterError(spec.field, "structured outputs need an engine with a tokenizer")
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self._tokenizer.backend_json(), self._vocab_size, self._tokenizer.eos_token_ids
            )
        compiler = self._compiler
        if spec.kind == "json_schema":
            return compiler.json_schema(spec.value, spec.field)
        if spec.kind == "json_object":
            return compiler.json_schema(True, spec.field)
        if spec.kind == "regex":
            return compiler.regex(spec.value, spec.field)
        if spec.kind == "choice":
            return compiler.choice(list(spec.value), spec.field)
        return compiler.lark(spec.value, spec.field)

    @staticmethod
    def cut_drafts(seqs: Mapping[int, Seq], drafts: Drafts) -> Drafts:
        """Deterministic drafts end before the first token the grammar forbids; sampled drafts are kept whole."""
        if drafts.probs is not None or not any(seqs[sid].grammar is not None for sid in drafts.token_ids):
            return drafts
        cut: dict[int, list[int]] = {}
        for sid, draft in drafts.token_ids.items():
            grammar = seqs[sid].grammar
            cut[sid] = draft if grammar is None else draft[: grammar.valid_prefix(draft)]
        return Drafts(cut, None, drafts.buckets, drafts.num_forwards, drafts.num_computed_tokens)

    @staticmethod
    def mask(
        logits: torch.Tensor,  # [sum(rows_per_seq), vocab_size]
        seqs: Sequence[Seq],
        drafts: Sequence[Sequence[int]],
        rows_per_seq: Sequence[int],
    ) -> torch.Tensor:  # [sum(rows_per_seq), vocab_size]; `logits` itself when no sequence is constrained
        masks: list[tuple[int, torch.Tensor]] = []
        first = 0
        for seq, draft, num_rows in zip(seqs, drafts, rows_per_seq, strict=True):
            if seq.grammar is not None:
                valid = seq.grammar.valid_prefix(draft)
                # Rows past a forbidden sampled draft token are never reached (it is rejected): left unmasked.
                masks.append((first, seq.grammar.row_masks(draft[:valid])))
            first += num_rows
        return apply_masks(logits, masks)

    @staticmethod
    def advance(seq: Seq, tokens: Sequence[int]) -> None:
        if seq.grammar is not None and tokens:
            seq.grammar.advance(tokens)
