"""Batched speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), exact and lossless.

For drafts d_1..d_k of one sequence, each sampled from a processed draft distribution q_j, and the target's
processed distributions p_1..p_{k+1} from one verification forward:
  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order;
  at the first rejection j, emit a correction from norm(max(0, p_j - q_j)) and stop;
  if all k are accepted, emit a bonus token from p_{k+1}.
Each emitted token is then distributed exactly as if sampled from p directly.

Randomness, per sequence and from that sequence's own generator: k_i uniforms (skipped when every
verification row is exactly one-hot -- one nonzero entry, as greedy rows are -- where acceptance is certain
either way), then one noise vector for the final token (skipped when that distribution is exactly
one-hot). So seeded runs reproduce whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specd.sampling.params import SamplingParams
from specd.sampling.processing import build_sampling_batch, is_one_hot, logits_to_probs, sample_from_probs


class RejectionResult(NamedTuple):
    """Per-sequence outcome of one verification step."""

    output_token_ids: list[list[int]]  # accepted drafts d_1..d_a, then one correction or bonus token
    num_accepted: list[int]  # a_i, 0 <= a_i <= k_i; len(output_token_ids[i]) == a_i + 1


def verify(
    target_logits: Tensor,  # [sum(k_i + 1), vocab_size], rows [last, d_1..d_k] per sequence
    draft_token_ids: Sequence[Sequence[int]],  # per sequence, k_i ids each
    draft_probs: Tensor | None,  # [sum(k_i), vocab_size] processed q in sequence order, or None: deterministic
    params: Sequence[SamplingParams],  # per sequence
    generators: Sequence[torch.Generator | None],  # per sequence
) -> RejectionResult:
    """Verify one step's drafts (k_i = 0 is plain sampling) with the cheapest exact rule.

    The one choice of verifier: when every request is greedy and the drafts are deterministic, `greedy_verify`
    makes the same decisions from the logits directly; otherwise the logits are processed into each request's
    distribution and `rejection_sample` runs. Changes only the generators.
    """
    num_draft = [len(draft) for draft in draft_token_ids]
    flat = [token for draft in draft_token_ids for token in draft]
    if draft_probs is None and all(p.greedy for p in params):
        return greedy_verify(target_logits, flat, num_draft)
    sampling = build_sampling_batch(params, [k + 1 for k in num_draft], target_logits.device)
    target_probs = logits_to_probs(target_logits, sampling)  # [sum(k_i + 1), vocab_size]
    return rejection_sample(target_probs, torch.tensor(flat, dtype=torch.long), draft_probs, num_draft, generators)


def rejection_sample(
    target_probs: Tensor,  # [sum(k_i + 1), vocab_size] float32, processed p for rows [last, d_1..d_k]
    draft_token_ids: Tensor,  # [sum(k_i)] int64, flattened in sequence order
    draft_probs: Tensor | None,  # [sum(k_i), vocab_size] float32 processed q, or None: q one-hot at draft
    num_draft_tokens: Sequence[int],  # k_i per sequence; 0 means plain sampling from its single row
    generators: Sequence[torch.Generator | None],  # one per sequence; None uses torch's default RNG
) -> RejectionResult:
    """Accept a prefix of each sequence's drafts and sample one more token; changes only the generators."""
    device = target_probs.device
    num_seqs = len(num_draft_tokens)
    num_drafts = sum(num_draft_tokens)
    _check_shapes(target_probs, draft_token_ids, draft_probs, num_draft_tokens, generators)
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)

    num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [num_seqs]
    cu_num_draft = torch.cumsum(num_draft, dim=0)  # [num_seqs]
    draft_start = cu_num_draft - num_draft  # [num_seqs] first flat draft index of each sequence
    # Sequence i's target rows start after i earlier "last token" rows plus all earlier drafts.
    target_start = draft_start + torch.arange(num_seqs, device=device)  # [num_seqs]

    seq_of_draft = torch.repeat_interleave(torch.arange(num_seqs, device=device), num_draft)  # [num_drafts]
    draft_index = torch.arange(num_drafts, device=device)  # [num_drafts]
    pos_in_seq = draft_index - draft_start[seq_of_draft]  # [num_drafts], j - 1 for draft d_j
    target_row_of_draft = draft_index + seq_of_draft  # [num_drafts] row holding p_j

    p_of_draft = target_probs[target_row_of_draft, draft_token_ids]  # [num_drafts]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs[draft_index, draft_token_ids]  # [num_drafts]

    uniforms = _draw_uniforms(target_probs, target_row_of_draft, seq_of_draft, num_draft_tokens, generators)
    # u * q < p is u < p / q without dividing: q(d) = 0 < p(d) accepts, p(d) = 0 always rejects, no NaN.
    # p >= q is accepted outright so that rounding in u * q cannot turn a certain accept into a reject.
    # With a one-hot p (greedy) p(d) is 0 or 1, so the zero uniforms used there decide correctly.
    accepted = (uniforms * q_of_draft < p_of_draft) | ((p_of_draft >= q_of_draft) & (p_of_draft > 0))

    max_num_draft = max(num_draft_tokens, default=0)
    accepted_per_pos = torch.zeros(num_seqs, max_num_draft, dtype=torch.int64, device=device)
    accepted_per_pos[seq_of_draft, pos_in_seq] = accepted.long()  # padding stays 0 = "rejected"
    # Length of the all-accepted prefix: the running product drops to 0 at the first rejection.
    num_accepted = accepted_per_pos.cumprod(dim=1).sum(dim=1)  # [num_seqs]

    final_probs = target_probs[target_start + num_accepted].float()  # [num_seqs, vocab_size]
    rejected_seqs = torch.nonzero(num_accepted < num_draft).squeeze(1)  # [num_rejected]
    if rejected_seqs.numel() > 0:
        rejected_draft = draft_start[rejected_seqs] + num_accepted[rejected_seqs]  # [num_rejected]
        if draft_probs is None:
            rejected_q = torch.zeros_like(final_probs[rejected_seqs])  # [num_rejected, vocab_size]
            rejected_q.scatter_(1, draft_token_ids[rejected_draft].unsqueeze(1), 1.0)
        else:
            rejected_q = draft_probs[rejected_draft].float()
        final_probs[rejected_seqs] = _correction_probs(final_probs[rejected_seqs], rejected_q)

    final_token_ids = sample_from_probs(final_probs, generators).tolist()
    num_accepted_list: list[int] = num_accepted.tolist()
    draft_list: list[int] = draft_token_ids.tolist()
    start_list: list[int] = draft_start.tolist()
    output_token_ids = [
        [*draft_list[start : start + num_acc], token]
        for start, num_acc, token in zip(start_list, num_accepted_list, final_token_ids)
    ]
    return RejectionResult(output_token_ids=output_token_ids, num_accepted=num_accepted_list)


def greedy_verify(
    target_logits: Tensor,  # [sum(k_i + 1), vocab_size], rows [last, d_1..d_k] per sequence
    draft_token_ids: Sequence[int],  # sum(k_i), flattened in sequence order
    num_draft_tokens: Sequence[int],  # k_i per sequence
) -> RejectionResult:
    """`rejection_sample` for a batch where every request is greedy and q is one-hot (deterministic drafts),
    without building [rows, vocab_size] distributions: accept while the draft equals the target's argmax,
    then emit the argmax at the first mismatch (correction) or after the last draft (bonus). Ties go to the
    lowest token id, as in the one-hot distributions `logits_to_probs` builds, so both paths agree exactly.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != sum(num_draft_tokens) + len(num_draft_tokens):
        raise ValueError(
            f"target_logits shape {tuple(target_logits.shape)} does not match k = {list(num_draft_tokens)}"
        )
    if len(draft_token_ids) != sum(num_draft_tokens):
        raise ValueError(f"got {len(draft_token_ids)} draft tokens for k = {list(num_draft_tokens)}")
    argmax: list[int] = target_logits.argmax(dim=-1).tolist()  # [num_rows]
    output_token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    row = draft = 0
    for k in num_draft_tokens:
        a = 0
        while a < k and draft_token_ids[draft + a] == argmax[row + a]:
            a += 1
        output_token_ids.append([*draft_token_ids[draft : draft + a], argmax[row + a]])
        num_accepted.append(a)
        row += k + 1
        draft += k
    return RejectionResult(output_token_ids=output_token_ids, num_accepted=num_accepted)


def _correction_probs(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """norm(max(0, p - q)) per row: [num_rows, vocab_size]. Both arguments [num_rows, vocab_size].

    A row whose residual is all zero (p == q up to rounding) falls back to p: a rejection there had
    (numerically) zero probability, so any choice is lossless, and p at least stays in the target's support.
    """
    residual = (target_probs - draft_probs).clamp_min_(0.0)  # [num_rows, vocab_size]
    mass = residual.sum(dim=-1, keepdim=True)  # [num_rows, 1]
    normalised = residual / mass.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(mass > 0, normalised, target_probs)


def _draw_uniforms(
    target_probs: Tensor,  # [num_target_rows, vocab_size]
    target_row_of_draft: Tensor,  # [num_drafts]
    seq_of_draft: Tensor,  # [num_drafts]
    num_draft_tokens: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """One uniform in [0, 1) per draft, [num_drafts] float32, each from its sequence's generator.

    Sequences whose verification rows are all exactly one-hot draw nothing and get zeros: their acceptance is
    certain either way, and greedy requests must stay deterministic without advancing their generator. "One-hot"
    means one nonzero entry, not a largest entry of 1.0: a float32 softmax rounds to 1.0 while other tokens
    still hold up to ~6e-8, and a zero uniform would then accept any draft with p(d) > 0.
    """
    device = target_probs.device
    num_drafts = int(target_row_of_draft.shape[0])
    uniforms = torch.zeros(num_drafts, dtype=torch.float32, device=device)
    if num_drafts == 0:
        return uniforms
    draft_row_is_random = ~is_one_hot(target_probs[target_row_of_draft])  # [num_drafts]
    num_random_rows = torch.zeros(len(num_draft_tokens), dtype=torch.int64, device=device)
    num_random_rows.index_add_(0, seq_of_draft, draft_row_is_random.long())
    seq_is_random: list[bool] = (num_random_rows > 0).tolist()

    uses_default_rng = [False] * len(num_draft_tokens)
    start = 0
    for seq, (num_draft, is_random) in enumerate(zip(num_draft_tokens, seq_is_random)):
        if is_random:
            generator = generators[seq]
            if generator is None:
                uses_default_rng[seq] = True
            else:
                # Drawn on the generator's own device (a CPU generator may serve a GPU batch).
                uniforms[start : start + num_draft] = torch.rand(
                    num_draft, generator=generator, device=generator.device
                )
        start += num_draft
    if any(uses_default_rng):
        # Unseeded sequences share torch's default RNG anyway, so one draw serves all of them.
        default_mask = torch.tensor(uses_default_rng, device=device)[seq_of_draft]  # [num_drafts]
        uniforms[default_mask] = torch.rand(int(default_mask.sum()), device=device)
    return uniforms


def _check_shapes(
    target_probs: Tensor,  # [sum(k_i + 1), vocab_size]
    draft_token_ids: Tensor,  # [sum(k_i)]
    draft_probs: Tensor | None,  # [sum(k_i), vocab_size]
    num_draft_tokens: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> None:
    num_seqs = len(num_draft_tokens)
    num_drafts = sum(num_draft_tokens)
    if any(k < 0 for k in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be >= 0, got {list(num_draft_tokens)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + num_seqs:
        raise ValueError(f"target_probs shape {tuple(target_probs.shape)} != [{num_drafts + num_seqs}, vocab_size]")
    if tuple(draft_token_ids.shape) != (num_drafts,):
        raise ValueError(f"draft_token_ids shape {tuple(draft_token_ids.shape)} != [{num_drafts}]")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, target_probs.shape[1]):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} != [{num_drafts}, {target_probs.shape[1]}]")
    if len(generators) != num_seqs:
        raise ValueError(f"got {len(generators)} generators for {num_seqs} sequences")
    vocab_size = target_probs.shape[1]
    if num_drafts and not (0 <= int(draft_token_ids.min()) and int(draft_token_ids.max()) < vocab_size):
        # A negative id would index from the end of the vocabulary and could be accepted and emitted.
        raise ValueError(f"draft_token_ids must lie in [0, {vocab_size})")
