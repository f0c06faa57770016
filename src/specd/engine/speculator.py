"""The engine's side of speculation: it drives the proposer and the k policies through their protocols.

It asks each sequence's k policy for k_i before scheduling, the proposer for drafts (handing it the policy's stop
rule), the policies for the prefix of each draft worth verifying, and after the step hands the proposer the
target's hidden states (when it asked for them) and the policies the step's outcome. It never looks at which
proposer or policy it has: everything specific lives behind speculation/proposer.py and speculation/k_policy.py.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import torch

from specd.config import SpeculationConfig
from specd.engine.runner import RunOutput
from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.errors import InvalidParameterError
from specd.sampling.params import SamplingParams
from specd.speculation.k_policy import DraftSpan, EngineLoad, KPolicy, StepReport, StepView
from specd.speculation.proposer import Proposer, SequenceView
from specd.speculation.registry import build_k_policies, k_policy_unsupported


@dataclass(frozen=True, slots=True)
class Drafts:
    """One step's drafts, as proposed and then cut by the k policies."""

    token_ids: dict[int, list[int]]  # seq_id -> drafts (decoding sequences that were given k_i > 0)
    probs: torch.Tensor | None  # [total_drafts, vocab_size] in token_ids order, or None: deterministic drafts
    buckets: dict[int, int]  # seq_id -> the proposer's own class of its draft (0 when it gives none)
    num_forwards: int = 0  # drafting cost as the proposer reported it (Proposal.num_draft_forwards)
    num_computed_tokens: int = 0  # and Proposal.num_computed_draft_tokens
    # seq_id -> the deterministic draft token just past the kept ones, for drafts that were cut (DraftOutcome's
    # next_matched compares the target's token with it)
    cut_next: dict[int, int] = field(default_factory=dict)


NO_DRAFTS = Drafts({}, None, {})


class Speculator:
    """Owns the proposer and one instance of every k policy the proposer supports (the engine's own policy and
    the ones a request may choose with SpecOverride.k_policy). Not thread-safe: owned by the engine thread.

    k_max: the engine's k_max, 0 when speculation is off (then nothing here is ever called with drafts).
    """

    def __init__(self, spec: SpeculationConfig, proposer: Proposer | None, vocab_size: int) -> None:
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.default_policy = spec.k_policy
        self.k_max = spec.num_speculative_tokens if (spec.enabled and proposer is not None) else 0
        self.k_policies: dict[str, KPolicy] = {}
        if proposer is not None and self.k_max:
            self.k_policies = build_k_policies(spec, proposer.traits)
            if spec.k_policy not in self.k_policies:
                raise InvalidParameterError(
                    "speculation.k_policy",
                    f"{spec.k_policy!r} does not work with {type(proposer).__name__}: "
                    f"{k_policy_unsupported(spec.k_policy, proposer.traits)}",
                )

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """The target's residual streams the proposer needs from every forward (None: none)."""
        return self.proposer.hidden_layers if self.proposer is not None else None

    # ------------------------------------------------------------ requests
    def request_policy(self, params: SamplingParams) -> tuple[int, KPolicy | None]:
        """A request's k_max and k policy: the engine's, or what its SpecOverride asks within them. Raises
        InvalidParameterError naming the override field it cannot honour."""
        k_max = self.k_max
        name = self.default_policy
        override = params.speculation
        if override is not None:
            if not override.enabled:
                return 0, None
            asks_speculation = (override.num_speculative_tokens or 0) > 0 or override.k_policy is not None
            if self.k_max == 0 and asks_speculation:
                field_name = "speculation" if override.k_policy is None else "speculation.k_policy"
                raise InvalidParameterError(field_name, "this engine was started without speculation")
            if override.num_speculative_tokens is not None:
                if override.num_speculative_tokens > self.k_max:
                    raise InvalidParameterError(
                        "speculation.num_speculative_tokens", f"must be <= the engine's k_max ({self.k_max})"
                    )
                k_max = override.num_speculative_tokens
            name = override.k_policy or name
        if k_max == 0:
            return 0, None
        policy = self.k_policies.get(name)
        if policy is None:
            assert self.proposer is not None  # k_max > 0
            reason = k_policy_unsupported(name, self.proposer.traits)
            raise InvalidParameterError("speculation.k_policy", f"{name!r} does not work with this engine: {reason}")
        return k_max, policy

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence everywhere: any policy may hold estimates about any sequence."""
        if self.proposer is not None:
            self.proposer.release(seq_id)
        for policy in self.k_policies.values():
            policy.release(seq_id)

    # ---------------------------------------------------------------- step
    def wanted_k(self, decoding: Seq[Sequence], load: EngineLoad) -> dict[int, int]:
        """schedule's input: the k_i each decoding sequence's policy asks for (the scheduler may cut it)."""
        by_policy: dict[KPolicy, list[Sequence]] = {}
        for seq in decoding:
            if seq.k_policy is not None:
                by_policy.setdefault(seq.k_policy, []).append(seq)
        wanted: dict[int, int] = {}
        for policy, seqs in by_policy.items():
            ks = policy.plan([seq.seq_id for seq in seqs], load)
            for seq, k in zip(seqs, ks, strict=True):
                if not 0 <= k <= seq.k_max:
                    raise RuntimeError(f"k policy {type(policy).__name__} planned k = {k} for k_max = {seq.k_max}")
                wanted[seq.seq_id] = k
        return wanted

    def propose(self, scheduled: Seq[ScheduledSeq]) -> Drafts:
        """Up to k_i drafts for every decoding sequence that was given k_i > 0; checked at this boundary."""
        decoding = [w for w in scheduled if not w.is_prefill and w.num_draft > 0]
        if not decoding or self.proposer is None:
            return NO_DRAFTS
        views = [
            SequenceView(
                w.seq.seq_id, w.seq.token_ids, w.seq.params, w.seq.generator,
                w.seq.k_policy.draft_stop(w.seq.seq_id) if w.seq.k_policy is not None else None,
                len(w.seq.prompt_token_ids),
            )
            for w in decoding
        ]
        proposal = self.proposer.propose(views, [w.num_draft for w in decoding])
        name = type(self.proposer).__name__
        token_ids = {}
        vocab = self.vocab_size
        for w, d in zip(decoding, proposal.draft_token_ids, strict=True):
            if len(d) > w.num_draft:
                raise RuntimeError(f"proposer {name} returned {len(d)} drafts for k_i = {w.num_draft}")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in d):
                # Checked here, at the boundary: a -1 placeholder would otherwise index the vocabulary from the end.
                raise RuntimeError(f"proposer {name} returned draft token ids outside [0, {vocab}): {d}")
            token_ids[w.seq.seq_id] = list(d)
        buckets = proposal.draft_buckets if proposal.draft_buckets is not None else [0] * len(decoding)
        if len(buckets) != len(decoding):
            raise RuntimeError(f"proposer {name} returned {len(buckets)} draft buckets for {len(decoding)} sequences")
        for field_name in ("num_draft_forwards", "num_computed_draft_tokens"):
            value = getattr(proposal, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RuntimeError(f"proposer {name} returned {field_name} = {value!r}; expected an integer >= 0")
        return Drafts(
            token_ids, proposal.draft_probs, {w.seq.seq_id: b for w, b in zip(decoding, buckets)},
            proposal.num_draft_forwards, proposal.num_computed_draft_tokens,
        )

    def plan(self, scheduled: Seq[ScheduledSeq], drafts: Drafts, max_num_batched_tokens: int) -> Drafts:
        """Each policy keeps a prefix of its sequences' drafts, seeing the whole step."""
        by_policy: dict[KPolicy, list[int]] = {}
        for w in scheduled:
            if not w.is_prefill and w.seq.k_policy is not None and drafts.token_ids.get(w.seq.seq_id):
                by_policy.setdefault(w.seq.k_policy, []).append(w.seq.seq_id)
        if not by_policy:
            return drafts
        token_ids = dict(drafts.token_ids)
        decode_only = not any(w.is_prefill for w in scheduled)
        for policy, seq_ids in by_policy.items():
            num_new_tokens = sum(w.num_prefill if w.is_prefill else 1 + len(token_ids.get(w.seq.seq_id, []))
                                 for w in scheduled)
            step = StepView(len(scheduled), num_new_tokens, max_num_batched_tokens, decode_only)
            spans = [DraftSpan(sid, len(token_ids[sid]), drafts.buckets.get(sid, 0)) for sid in seq_ids]
            for span, kept in zip(spans, policy.keep(spans, step), strict=True):
                if not 0 <= kept <= span.num_tokens:
                    raise RuntimeError(f"k policy {type(policy).__name__} kept {kept} of {span.num_tokens} drafts")
                token_ids[span.seq_id] = token_ids[span.seq_id][:kept]
        probs = drafts.probs
        if probs is not None:  # keep the rows of the kept draft tokens (proposal order = dict order)
            rows: list[int] = []
            offset = 0
            for sid, d in drafts.token_ids.items():
                rows.extend(range(offset, offset + len(token_ids[sid])))
                offset += len(d)
            if len(rows) < offset:
                probs = probs[torch.tensor(rows, dtype=torch.long)]  # [num_kept_drafts, vocab_size]
        return Drafts(token_ids, probs, drafts.buckets, drafts.num_forwards, drafts.num_computed_tokens)

    @staticmethod
    def cut_next(proposed: Drafts, verified: Drafts) -> Drafts:
        """`verified` with cut_next set: for each deterministic draft verified shorter than it was proposed (cut
        by a policy or a constraint), the proposed token after the verified ones."""
        if proposed.probs is not None:
            return verified  # a draft with a distribution is accepted by another rule than a match
        cut_next = {sid: d[len(verified.token_ids.get(sid, []))] for sid, d in proposed.token_ids.items()
                    if len(verified.token_ids.get(sid, [])) < len(d)}
        return replace(verified, cut_next=cut_next) if cut_next else verified

    def observe_hidden_states(
        self, scheduled: Seq[ScheduledSeq], run: RunOutput, num_emitted: dict[int, int]
    ) -> None:
        """The target's features of the rows each still-running sequence kept, to a proposer that asked.

        num_emitted: seq_id -> tokens each sampled sequence emitted this step.
        """
        if self.proposer is None or run.hidden_states is None:
            return
        seq_ids: list[int] = []
        starts: list[int] = []
        features: list[torch.Tensor] = []
        for index, work in enumerate(scheduled):
            seq = work.seq
            if seq.finish_reason is not None:
                continue  # finishing: the proposer releases it
            # A prompt chunk keeps all its rows; a decode keeps the rows behind the tokens it emitted.
            num_kept = work.num_prefill if work.is_prefill else num_emitted[seq.seq_id]
            offset = run.token_offsets[index]
            seq_ids.append(seq.seq_id)
            starts.append(run.start_positions[index])
            features.append(run.hidden_states[offset : offset + num_kept])  # [num_kept, num_features]
        if seq_ids:
            self.proposer.observe(seq_ids, starts, features)

    def observe(self, report: StepReport) -> None:
        """Every policy learns from every finished step."""
        for policy in self.k_policies.values():
            policy.observe(report)

    def snapshots(self) -> dict[str, dict[str, object]]:
        """Each policy's estimates, by policy name (policies without any are left out)."""
        out: dict[str, dict[str, object]] = {}
        for name, policy in self.k_policies.items():
            estimates = policy.snapshot()
            if estimates is not None:
                out[name] = estimates
        return out
