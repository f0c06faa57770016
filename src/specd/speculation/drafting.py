"""The per-position drafting loop shared by the model-based proposers (`draft`/`layerskip` and `eagle`).

Both run a model one draft position per forward over the sequences still drafting. Around each forward they do the
same three things, written once here: ask each sequence's stop rule with the model's raw top probability (before
sampling, see DraftStop), sample from the request's processed distribution, and append the token and its
distribution, advancing the sequence's next input. What differs between them -- which model runs, what it reads
besides tokens, how its cache catches up -- stays in the proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.sampling.processing import sample_from_probs
from specd.speculation.proposer import Proposal, SequenceView


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftLoop:
    """One `propose` call's drafting state; sequences are indices into `seqs`.

    feed[i]: the tokens sequence i's next forward reads (first the catch-up rows, then its newest draft);
    starts[i]: the position of feed[i][0]. The proposer fills both for the sequences it drafts for before the first
    forward; `append` advances them.
    """

    def __init__(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> None:
        self.seqs = seqs
        self.num_draft_tokens = num_draft_tokens
        self.drafts: list[list[int]] = [[] for _ in seqs]
        self._probs: list[list[torch.Tensor]] = [[] for _ in seqs]  # per sequence, [vocab_size] per draft
        self.feed: dict[int, list[int]] = {}
        self.starts: dict[int, int] = {}
        # What drafting cost, for the metrics (Proposal.num_draft_forwards / num_computed_draft_tokens): every
        # forward hands its logits to drop_stopped, so it is counted there, dropped positions included.
        self.num_forwards = 0
        self.num_computed = 0

    def drop_stopped(self, active: list[int], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The sequences (and their logits rows) whose stop rule lets them draft the next position.

        logits: [len(active), vocab] raw scores of the model. The rule reads the raw top probability, before the
        request's temperature and filters and before sampling, so it never depends on the token drawn there.
        Called once per forward: it counts the forward and the positions it computed (the drafting cost).
        """
        self.num_forwards += 1
        self.num_computed += len(active)
        if all(self.seqs[i].draft_stop is None for i in active):
            return active, logits
        top_probs = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()  # [len(active)]
        kept = [row for row, i in enumerate(active) if not self._stops(i, top_probs[row])]
        return [active[row] for row in kept], logits[kept]

    def _stops(self, i: int, top_prob: float) -> bool:
        rule = self.seqs[i].draft_stop
        return rule is not None and rule.stop(len(self.drafts[i]), top_prob)

    def append(self, active: list[int], q: torch.Tensor) -> list[int]:
        """Sample each active sequence's next draft from q [len(active), vocab_size]; return those still drafting."""
        tokens = sample_from_probs(q, [self.seqs[i].generator for i in active]).tolist()  # [len(active)]
        still: list[int] = []
        for row, i in enumerate(active):
            self.drafts[i].append(tokens[row])
            self._probs[i].append(q[row])
            if len(self.drafts[i]) < self.num_draft_tokens[i]:
                still.append(i)
                self.starts[i] += len(self.feed[i])
                self.feed[i] = [tokens[row]]
        return still

    def proposal(self) -> Proposal:
        """The drafts and their distributions, flattened in sequence order."""
        rows = [p for per_seq in self._probs for p in per_seq]
        draft_probs = torch.stack(rows) if rows else None  # [total_drafts, vocab_size]
        return Proposal(self.drafts, draft_probs, None, self.num_forwards, self.num_computed)
