"""The `eagle` proposer: a trained draft head (model/draft_head.py) that drafts from the target's own features.

Per sequence the proposer keeps the head's KV cache and the target features it has been handed (`observe`).
Head row p reads token x_p and the target's feature of position p - 1, so at each `propose` it first catches up,
in one ragged forward over all sequences, on every committed row its cache does not hold exactly; drafting then
feeds the head's own output back as the feature, one position per forward. Draft rows are never kept: the next
call recomputes them from the target's features of the tokens the target actually committed (head rows are valid
only up to the committed tokens the proposer has compared against, as for the `draft` proposer), so the head's
KV cache after any mix of accepts, rejects and stop truncation equals a fresh prefill of the committed tokens.

Drafts are sampled from the request's processed distribution over the draft vocabulary (zero elsewhere) and
returned with it, so rejection sampling keeps sampled output exactly the target's. A k policy's stop rule is asked
before each position with the head's raw top probability, read before sampling (see DraftStop).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specd.errors import ModelLoadError
from specd.model.attention import ForwardBatch
from specd.model.draft_head import HEAD_CONFIG_FILE, DraftHead, target_fingerprint
from specd.model.llama import LlamaForCausalLM
from specd.sampling.processing import build_sampling_batch, logits_to_probs
from specd.speculation.drafting import DraftLoop, common_prefix
from specd.speculation.proposer import Proposal, Proposer, ProposerTraits, SequenceView

if TYPE_CHECKING:
    from specd.config import EngineConfig
    from specd.model.tokenizer import Tokenizer


class _SeqState:
    """One sequence's head state: its KV slot, the tokens of the head rows computed from the target's features
    (rows 0..len(rows)-1 are exact), and the target features of positions feature_start.. not consumed yet."""

    __slots__ = ("feature_start", "features", "rows", "slot")

    def __init__(self, slot: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.slot = slot
        self.rows: list[int] = []
        self.feature_start = 0
        self.features = torch.zeros(0, hidden_size, dtype=dtype)  # [num_kept_features, hidden_size]

    def add_features(self, start: int, rows: torch.Tensor) -> None:  # rows: [n, hidden_size] for start..start+n-1
        keep = max(0, min(start - self.feature_start, self.features.shape[0]))
        if start > self.feature_start + self.features.shape[0] or start < self.feature_start:
            keep, self.feature_start = 0, start  # a gap or a rewrite before what we hold: start over from here
        self.features = torch.cat([self.features[:keep], rows.to(self.features.dtype)])

    def feature_rows(self, first: int, last: int) -> torch.Tensor | None:  # [last - first, hidden] or None
        """Features of positions first..last-1 (position -1 is the zero feature of row 0), if all are held."""
        zeros = 0
        if first < 0:
            zeros, first = -first, 0
        lo, hi = first - self.feature_start, last - self.feature_start
        if lo < 0 or hi > self.features.shape[0]:
            return None
        held = self.features[lo:hi]
        return torch.cat([held.new_zeros(zeros, held.shape[1]), held]) if zeros else held

    def drop_features_before(self, position: int) -> None:
        cut = max(0, min(position - self.feature_start, self.features.shape[0]))
        self.features = self.features[cut:]
        self.feature_start += cut


class EagleProposer(Proposer):
    """Drafts with a DraftHead; needs the target's final normed hidden state of every committed position."""

    traits = ProposerTraits(stops_while_drafting=True)
    hidden_layers = (-1,)

    def __init__(self, head: DraftHead, max_slots: int, max_len: int) -> None:
        self.head = head
        self.cache = head.make_cache(max_slots, max_len)
        self.vocab_size = int(head.embed.weight.shape[0])
        self._dtype = head.norm.weight.dtype
        self._seqs: dict[int, _SeqState] = {}

    def observe(self, seq_ids: Sequence[int], start_positions: Sequence[int],
                hidden_per_seq: Sequence[torch.Tensor]) -> None:
        for seq_id, start, rows in zip(seq_ids, start_positions, hidden_per_seq, strict=True):
            state = self._state(seq_id)
            state.add_features(start, rows)

    def release(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.cache.free(state.slot)

    def _state(self, seq_id: int) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            state = _SeqState(self.cache.allocate(), self.head.arch.hidden_size, self._dtype)
            self._seqs[seq_id] = state
        return state

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, draft_vocab] -> [rows, vocab] (-inf off map)
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head.token_map] = logits
        return full

    def propose(self, seqs: Sequence[SequenceView], num_draft_tokens: Sequence[int]) -> Proposal:
        loop = DraftLoop(seqs, num_draft_tokens)
        # Catch-up rows per sequence: head rows [start, n) need the target features of positions start-1..n-2.
        feed, starts = loop.feed, loop.starts
        features: dict[int, torch.Tensor] = {}
        for i, k in enumerate(num_draft_tokens):
            if k <= 0:
                continue
            tokens = seqs[i].token_ids
            state = self._state(seqs[i].seq_id)
            start = min(common_prefix(state.rows, tokens), len(tokens) - 1)
            rows = state.feature_rows(start - 1, len(tokens) - 1)
            if rows is None:
                continue  # the target's features of these tokens never came: no draft (the target decodes alone)
            state.rows = list(tokens[:start])
            feed[i], starts[i], features[i] = list(tokens[start:]), start, rows
        active = sorted(feed, key=lambda i: self._seqs[seqs[i].seq_id].slot)
        if not active:
            return loop.proposal()
        self.cache.reserve(max(len(seqs[i].token_ids) + num_draft_tokens[i] for i in active))
        first = True
        while active:
            batch = ForwardBatch.build(
                [feed[i] for i in active],
                [self._seqs[seqs[i].seq_id].slot for i in active],
                [starts[i] for i in active],
                [[len(feed[i]) - 1] for i in active],
            )
            out = self.head(batch, self.cache, torch.cat([features[i] for i in active]))
            last_rows = (torch.tensor([len(feed[i]) for i in active]).cumsum(0) - 1).tolist()
            for row, i in zip(last_rows, active):
                state = self._seqs[seqs[i].seq_id]
                self.cache.set_len(state.slot, starts[i] + len(feed[i]))
                if first:  # rows computed from the target's features: exact, kept across steps
                    state.rows.extend(feed[i])
                    state.drop_features_before(len(seqs[i].token_ids) - 1)
                features[i] = out.hidden[row : row + 1]  # [1, hidden]: the head's own output, fed back
            first = False
            active, logits = loop.drop_stopped(active, out.logits)  # logits: [num_kept, draft_vocab]
            if not active:
                break
            sampling = build_sampling_batch([seqs[i].params for i in active], [1] * len(active), logits.device)
            active = loop.append(active, logits_to_probs(self._full_vocab(logits), sampling))  # q: [n, vocab_size]
        return loop.proposal()


def shipped_heads() -> list[Path]:
    """Directories of the heads shipped in the package (specd/heads/*/)."""
    root = Path(str(resources.files("specd") / "heads"))
    return sorted(p for p in root.iterdir() if (p / HEAD_CONFIG_FILE).is_file()) if root.is_dir() else []


def find_shipped_head(target: LlamaForCausalLM) -> Path | None:
    """The shipped head trained for `target` (matched by fingerprint), if any."""
    import json

    fingerprint = target_fingerprint(target)
    for directory in shipped_heads():
        if json.loads((directory / HEAD_CONFIG_FILE).read_text()).get("target_fingerprint") == fingerprint:
            return directory
    return None


def build_eagle(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Tokenizer | None) -> EagleProposer:
    """`eagle`: the head in `draft_model`, or the one shipped for this target."""
    path = config.speculation.draft_model
    directory = Path(path) if path else find_shipped_head(target)
    if directory is None:
        raise ModelLoadError(
            "speculation.draft_model: no draft head is shipped for this model; train one with "
            "`specd train-draft --model ... --out DIR` and pass --draft-model DIR"
        )
    head = DraftHead.load(directory, target).for_inference(target.dtype)
    return EagleProposer(head, config.max_num_seqs, config.max_model_len)
