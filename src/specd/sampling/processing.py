"""Turn target (or draft) logits into each request's processed distribution, and sample from it.

The processed distribution p is what the request actually samples from: logits / temperature, then top-k,
top-p and min-p (vLLM's order), renormalised. The rejection sampler compares these processed
distributions, so speculation is lossless with respect to exactly what a non-speculative run would sample.

Greedy rows become exactly one-hot at the argmax. That makes "accept with probability p(d) / q(d)" reduce to
"accept iff d == argmax" and lets `sample_from_probs` skip randomness for them, so the rejection rule needs no
greedy case. The one greedy shortcut downstream is `rejection.greedy_verify`, which makes those same decisions
from the logits, without building distributions, when a whole step is greedy with deterministic drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specd.sampling.params import SamplingParams

# Top-p first looks for its cut-off among this many most likely tokens and only widens the search (x4) for
# rows whose nucleus is larger: a full sort of a 49k vocabulary costs ~30x a top-256 on CPU.
_TOP_P_FIRST_CANDIDATES = 256
_TOP_P_GROWTH = 4


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, built once per step by `build_sampling_batch`.

    Filters of greedy rows are stored as "off" so they never force the batch onto a slower path.
    The Python flags let `logits_to_probs` skip top-k / top-p / min-p work when no row asked for it.
    """

    temperature: Tensor  # [num_rows] float32, 0 for greedy rows
    top_k: Tensor  # [num_rows] int64, 0 = off
    top_p: Tensor  # [num_rows] float32, 1 = off
    min_p: Tensor  # [num_rows] float32, 0 = off
    greedy: Tensor  # [num_rows] bool
    max_top_k: int  # largest active top_k (0 when no row uses top-k); sizes the torch.topk call
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    any_greedy: bool
    all_greedy: bool

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


def build_sampling_batch(
    params: Sequence[SamplingParams], rows_per_seq: Sequence[int], device: torch.device
) -> SamplingBatch:
    """Expand per-sequence params to per-row tensors: sequence i owns rows_per_seq[i] consecutive rows."""
    if len(params) != len(rows_per_seq):
        raise ValueError(f"got {len(params)} SamplingParams for {len(rows_per_seq)} sequences")
    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    greedy: list[bool] = []
    for seq_params, num_rows in zip(params, rows_per_seq):
        if num_rows < 0:
            raise ValueError(f"rows_per_seq must be >= 0, got {num_rows}")
        greedy_row = seq_params.greedy
        temperature += [0.0 if greedy_row else float(seq_params.temperature)] * num_rows
        top_k += [0 if greedy_row else max(seq_params.top_k, 0)] * num_rows
        top_p += [1.0 if greedy_row else float(seq_params.top_p)] * num_rows
        min_p += [0.0 if greedy_row else float(seq_params.min_p)] * num_rows
        greedy += [greedy_row] * num_rows
    return SamplingBatch(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        max_top_k=max(top_k, default=0),
        needs_top_k=any(k > 0 for k in top_k),
        needs_top_p=any(p < 1.0 for p in top_p),
        needs_min_p=any(p > 0.0 for p in min_p),
        any_greedy=any(greedy),
        all_greedy=all(greedy),
    )


def logits_to_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Processed distribution per row: [num_rows, vocab_size] float32 (a new tensor; `logits` is untouched).

    logits: [num_rows, vocab_size], any float dtype. Filters keep every token tied with the cut-off, so the
    result does not depend on how a sort orders equal values.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {batch.num_rows} rows")
    if batch.all_greedy:
        return _one_hot_argmax(logits)

    temperature = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits.float() / temperature.unsqueeze(1)  # [num_rows, vocab_size]
    if batch.needs_top_k:
        scaled = _apply_top_k(scaled, batch.top_k, batch.max_top_k)
    probs = torch.softmax(scaled, dim=-1)  # [num_rows, vocab_size]

    # Top-p is measured on the top-k-renormalised distribution (vLLM's order). Min-p compares with the
    # row's max, which no earlier filter removes, and the ratio p / max p is unchanged by renormalising,
    # so both masks can be taken from these probs and applied together.
    if batch.needs_top_p or batch.needs_min_p:
        drop = torch.zeros_like(probs, dtype=torch.bool)  # [num_rows, vocab_size]
        if batch.needs_top_p:
            drop |= probs < _top_p_min_kept_prob(probs, batch.top_p).unsqueeze(1)
        if batch.needs_min_p:
            drop |= probs < batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(drop, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))

    if batch.any_greedy:
        probs = torch.where(batch.greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def sample_from_probs(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token id per row: [num_rows] int64. Row r draws from generators[r] (None: torch's default RNG).

    probs: [num_rows, vocab_size], each row a distribution. Uses the exponential race argmax(p / E) with
    E ~ Exp(1) i.i.d. per token, which picks token t with probability p(t). Each sampled row draws one
    vocab_size uniform vector from its own generator, so a seeded request's stream does not depend on its
    batch neighbours. Exactly one-hot rows (greedy) are answered by argmax and consume nothing from their
    generator; a row whose largest entry merely rounds to 1.0 is still sampled.
    """
    num_rows, vocab_size = probs.shape
    if len(generators) != num_rows:
        raise ValueError(f"got {len(generators)} generators for {num_rows} rows")
    token_ids = probs.argmax(dim=-1)  # [num_rows]
    random_rows = torch.nonzero(~is_one_hot(probs)).squeeze(1).tolist()
    if not random_rows:
        return token_ids

    # E = -log(1 - U) with U uniform: an exact Exp(1) draw, ~3x faster on CPU than Tensor.exponential_.
    noise = torch.empty(len(random_rows), vocab_size, dtype=torch.float32, device=probs.device)
    default_rng_slots: list[int] = []
    for slot, row in enumerate(random_rows):
        generator = generators[row]
        if generator is None:
            default_rng_slots.append(slot)
        else:
            # Drawn on the generator's own device (a CPU generator may serve a GPU batch).
            noise[slot] = torch.rand(vocab_size, generator=generator, device=generator.device)
    if default_rng_slots:
        noise[default_rng_slots] = torch.rand(len(default_rng_slots), vocab_size, device=probs.device)
    noise.neg_().log1p_().neg_()
    # U = 0 gives E = 0, and 0 / 0 would be NaN, which argmax treats as the maximum.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    token_ids[random_rows] = (probs[random_rows].float() / noise).argmax(dim=-1)
    return token_ids


def is_one_hot(probs: Tensor) -> Tensor:  # [num_rows, vocab_size] -> [num_rows] bool
    """Rows with exactly one nonzero entry: deterministic, whatever the request asked for.

    The one test for "no randomness needed" in sampling and verification. A largest entry of 1.0 is not enough:
    float32 softmax reaches 1.0 while other tokens still hold up to ~6e-8.
    """
    return (probs != 0).sum(dim=-1) == 1


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[num_rows, vocab_size] float32 one-hot at each row's argmax (ties: lowest index, torch's rule)."""
    token_ids = logits.argmax(dim=-1, keepdim=True)  # [num_rows, 1]
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, token_ids, 1.0)


def _apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Mask (in place) logits below each row's k-th largest; top_k 0 or >= vocab_size keeps the row whole.

    logits: [num_rows, vocab_size] float32; top_k: [num_rows] int64.
    """
    vocab_size = logits.shape[1]
    active = (top_k > 0) & (top_k < vocab_size)  # [num_rows]
    num_candidates = max_top_k
    if max_top_k >= vocab_size:
        # A k covering the whole vocabulary is "off"; size the search by the rows that do filter.
        active_k = top_k[active]
        if active_k.numel() == 0:
            return logits
        num_candidates = int(active_k.max())
    top_values = logits.topk(num_candidates, dim=-1).values  # [num_rows, num_candidates], descending
    kth_index = (top_k.clamp(1, num_candidates) - 1).unsqueeze(1)  # [num_rows, 1]
    kth_value = top_values.gather(1, kth_index).squeeze(1)  # [num_rows]
    threshold = torch.where(active, kth_value, torch.full_like(kth_value, -torch.inf))
    return logits.masked_fill_(logits < threshold.unsqueeze(1), -torch.inf)


def _top_p_min_kept_prob(probs: Tensor, top_p: Tensor) -> Tensor:
    """Smallest probability kept by top-p per row: [num_rows] float32 (0 for rows with top_p >= 1).

    probs: [num_rows, vocab_size]; top_p: [num_rows]. A token is kept when the mass of the tokens ranked
    above it is < top_p, i.e. the smallest prefix reaching top_p, boundary token included. The nucleus is
    searched among the top candidates only; rows whose nucleus is wider are retried with more candidates,
    ending with the whole vocabulary.
    """
    num_rows, vocab_size = probs.shape
    min_kept = torch.zeros(num_rows, dtype=torch.float32, device=probs.device)
    pending = torch.nonzero(top_p < 1.0).squeeze(1)  # [num_pending] row ids
    num_candidates = _TOP_P_FIRST_CANDIDATES
    while pending.numel() > 0:
        num_candidates = min(num_candidates, vocab_size)
        top_values = probs[pending].topk(num_candidates, dim=-1).values  # [num_pending, num_candidates]
        cum_mass = top_values.cumsum(dim=-1)  # [num_pending, num_candidates]
        mass_before = cum_mass - top_values
        num_kept = (mass_before < top_p[pending].unsqueeze(1)).sum(dim=-1)  # [num_pending], >= 1
        # The cut-off is known once some candidate is excluded; with every candidate kept, a token
        # outside them might still be needed, unless the candidates are the whole vocabulary.
        resolved = (num_kept < num_candidates) | (num_candidates == vocab_size)
        kept_value = top_values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
        min_kept[pending[resolved]] = kept_value[resolved]
        pending = pending[~resolved]
        num_candidates *= _TOP_P_GROWTH
    return min_kept
