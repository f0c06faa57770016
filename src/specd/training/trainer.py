"""Training a draft head on recorded target features, with an unrolled "training-time test" (EAGLE-3).

Depth 1 of the unrolled forward is what the head sees for committed tokens: the target's feature of the previous
position. Depth j > 1 feeds the head's own depth j - 1 output instead, exactly as drafting the j-th token does,
and attends to the depth-1 keys of the committed prefix plus its own chain's keys (`unrolled_mask`), so training
sees the errors the head will compound while drafting. Every depth is scored against the target's distribution at
the same position (restricted to the draft vocabulary) plus a regression of its output onto the target's feature.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specd.errors import InvalidParameterError
from specd.model.draft_head import DraftHead
from specd.model.llama import apply_rotary
from specd.training.data import Sample
from specd.training.progress import Progress


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """epochs: passes over the training split; training also stops at `max_train_s` seconds (None: no limit). The
    defaults fit `specd train-draft` into an hour on a loaded 2-core CPU, where the time limit ends training.
    batch_tokens: padded tokens per optimiser step. depth: unrolled draft positions trained (1 = plain EAGLE-1).
    regression_weight: weight of the feature regression next to the distillation loss. decay: weight of depth j is
    decay ** (j - 1)."""

    epochs: int = 40
    batch_tokens: int = 1024
    learning_rate: float = 3e-3
    depth: int = 1
    regression_weight: float = 1.0
    decay: float = 0.8
    max_train_s: float | None = 20 * 60
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_tokens", "depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"--{name.replace('_', '-')}", f"must be an integer >= 1, got {value!r}")
        if not self.learning_rate > 0:
            raise InvalidParameterError("--learning-rate", "must be > 0")
        if self.regression_weight < 0:
            raise InvalidParameterError("--regression-weight", "must be >= 0")
        if not 0 < self.decay <= 1:
            raise InvalidParameterError("--decay", "must be in (0, 1]")
        if self.max_train_s is not None and not self.max_train_s > 0:
            raise InvalidParameterError("--train-minutes", "must be > 0")


def unrolled_mask(length: int, depth: int) -> torch.Tensor:  # [length, depth * length] bool, True = attend
    """Keys a depth-`depth` query at row r reads: depth-1 keys of rows <= r - depth + 1 (the committed prefix its
    chain starts from) and, for each depth i in 2..depth, the key of row r - depth + i (its own chain)."""
    rows = torch.arange(length).unsqueeze(1)  # [length, 1]
    cols = torch.arange(length).unsqueeze(0)  # [1, length]
    blocks = [cols <= rows - depth + 1]
    blocks += [cols == rows - depth + i for i in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


class Batch(NamedTuple):
    token_ids: torch.Tensor  # [batch, length] int64 (0 past each sequence's end)
    features: torch.Tensor  # [batch, length, hidden] float32 (0 past the end)
    valid: torch.Tensor  # [batch, length] bool, rows inside the sequence
    scored: torch.Tensor  # [batch, length] bool, rows whose prediction counts for acceptance (the answer)


def make_batch(samples: Sequence[Sample]) -> Batch:
    length = max(len(s.token_ids) for s in samples)
    hidden = samples[0].features.shape[1]
    token_ids = torch.zeros(len(samples), length, dtype=torch.long)
    features = torch.zeros(len(samples), length, hidden)
    valid = torch.zeros(len(samples), length, dtype=torch.bool)
    scored = torch.zeros(len(samples), length, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        token_ids[row, :n] = sample.token_ids
        features[row, :n] = sample.features.float()
        valid[row, :n] = True
        # Row p predicts token p + 1: the answer's tokens are predicted from the prompt's last row onwards.
        scored[row, sample.num_prompt_tokens - 1 : n - 1] = True
    return Batch(token_ids, features, valid, scored)


def unrolled_forward(head: DraftHead, token_ids: torch.Tensor, features: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:  # depth x [batch, length, hidden], normed outputs
    """The head over whole sequences at depths 1..depth (see the module docstring). Differentiable."""
    batch, length = token_ids.shape
    layer = head.layer
    num_heads, num_kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    positions = torch.arange(length).repeat(batch)  # [batch * length]
    rope = head.rotary.tables(positions, features.dtype)
    flat_ids = token_ids.reshape(-1)
    zero = features.new_zeros(batch, 1, features.shape[-1])
    previous = torch.cat([zero, features[:, :-1]], dim=1)  # [batch, length, hidden]: feature of position p - 1
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for level in range(1, depth + 1):
        x = head.fuse(flat_ids, previous.reshape(batch * length, -1))  # [batch * length, hidden]
        qkv = layer.qkv_proj(layer.input_layernorm(x))
        v = qkv[:, layer.q_size + layer.kv_size :].view(batch * length, num_kv_heads, head_dim)
        qk = qkv[:, : layer.q_size + layer.kv_size].view(batch * length, num_heads + num_kv_heads, head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat([layer.q_norm(qk[:, :num_heads]), layer.k_norm(qk[:, num_heads:])], dim=1)
        qk = apply_rotary(qk, *rope)
        q = qk[:, :num_heads].view(batch, length, num_heads, head_dim).transpose(1, 2)
        keys.append(qk[:, num_heads:].view(batch, length, num_kv_heads, head_dim).transpose(1, 2))
        values.append(v.view(batch, length, num_kv_heads, head_dim).transpose(1, 2))
        attn = F.scaled_dot_product_attention(
            q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=unrolled_mask(length, level),
            enable_gqa=True, scale=1.0,  # the rotary tables already scaled the query rows by head_dim ** -0.5
        )  # [batch, num_heads, length, head_dim]
        hidden = x + layer.o_proj(attn.transpose(1, 2).reshape(batch * length, num_heads * head_dim))
        gate, up = layer.gate_up_proj(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        hidden = hidden + layer.down_proj(F.silu(gate) * up)
        normed = head.norm(hidden).view(batch, length, -1)
        outputs.append(normed)
        previous = torch.cat([zero, normed[:, :-1]], dim=1)
    return outputs


class LossParts(NamedTuple):
    total: torch.Tensor  # scalar, differentiable
    distill: list[float]  # per depth, soft cross-entropy against the target (nats)
    regression: list[float]  # per depth, smooth-L1 to the target's feature


def loss_of(head: DraftHead, batch: Batch, config: TrainConfig) -> LossParts:
    """Scored on the answer rows only (where the head will draft); the prompt rows are context."""
    outputs = unrolled_forward(head, batch.token_ids, batch.features, config.depth)
    total = batch.features.new_zeros(())
    distill: list[float] = []
    regression: list[float] = []
    for level, normed in enumerate(outputs, start=1):
        # A depth-j row needs a chain that starts at a committed row with a real feature: r >= j.
        rows = batch.scored.clone()
        rows[:, :level] = False
        target = batch.features[rows]  # [num_rows, hidden]
        with torch.no_grad():
            target_p = F.softmax(head.scores(target), dim=-1)  # [num_rows, draft_vocab]
        ce = -(target_p * F.log_softmax(head.scores(normed[rows]), dim=-1)).sum(-1).mean()
        reg = F.smooth_l1_loss(normed[rows], target)
        total = total + config.decay ** (level - 1) * (ce + config.regression_weight * reg)
        distill.append(float(ce.detach()))
        regression.append(float(reg.detach()))
    return LossParts(total, distill, regression)


@torch.no_grad()
def acceptance(head: DraftHead, samples: Sequence[Sample], num_positions: int,
               batch_tokens: int = 4096) -> list[float]:
    """Greedy per-position acceptance on held-out answers: entry j-1 is the share of draft chains (one starting at
    every answer position) whose first j tokens all equal the target's own (greedy) continuation."""
    chains = [0] * num_positions
    accepted = [0] * num_positions
    for group in _batches(samples, batch_tokens, shuffle=False, seed=0):
        batch = make_batch(group)
        outputs = unrolled_forward(head, batch.token_ids, batch.features, num_positions)
        following = torch.cat([batch.token_ids[:, 1:], torch.zeros_like(batch.token_ids[:, :1])], dim=1)
        matches = [head.token_map[head.scores(o).argmax(-1)] == following for o in outputs]  # [batch, length] each
        length = batch.token_ids.shape[1]
        all_so_far = torch.ones_like(batch.scored)
        for j in range(num_positions):
            # Chain from committed row s drafts row s + j at depth j + 1.
            shifted = torch.zeros_like(matches[j])
            shifted[:, : length - j] = matches[j][:, j:]
            reaches = torch.zeros_like(batch.scored)
            reaches[:, : length - j] = batch.scored[:, j:]
            chain_rows = batch.scored & reaches  # the draft position still lies in the answer
            all_so_far = all_so_far & shifted
            chains[j] += int(chain_rows.sum())
            accepted[j] += int((all_so_far & chain_rows).sum())
    return [a / c if c else 0.0 for a, c in zip(accepted, chains)]


def mean_acceptance_length(per_position: Sequence[float], k: int) -> float:
    """tau at k drafts with greedy verification: 1 (the target's own token) + expected accepted drafts."""
    return 1.0 + sum(per_position[:k])


def _batches(samples: Sequence[Sample], batch_tokens: int, shuffle: bool, seed: int) -> list[list[Sample]]:
    """Sequences of similar length grouped so that batch x longest <= batch_tokens (at least one per batch)."""
    ordered = sorted(samples, key=lambda s: len(s.token_ids))
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in ordered:
        if current and (len(current) + 1) * len(sample.token_ids) > batch_tokens:
            groups.append(current)
            current = []
        current.append(sample)
    if current:
        groups.append(current)
    if shuffle:
        random.Random(seed).shuffle(groups)
    return groups


class TrainHistory(NamedTuple):
    steps: list[int]
    train_loss: list[float]
    train_distill: list[list[float]]  # per step, per depth
    held_out_loss: list[tuple[int, float]]  # (step, loss) after every epoch
    seconds: float


def train(head: DraftHead, train_set: Sequence[Sample], held_out: Sequence[Sample],
          config: TrainConfig) -> TrainHistory:
    """Train `head` in place (fc, layer, norm; the borrowed LM-head rows stay frozen) with AdamW and a cosine
    schedule; returns the loss curve."""
    torch.manual_seed(config.seed)
    params = [p for name, p in head.named_parameters() if p.requires_grad and not name.startswith("lm_head")]
    optimiser = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    plan = [_batches(train_set, config.batch_tokens, True, config.seed + e) for e in range(config.epochs)]
    total_steps = sum(len(p) for p in plan)
    warmup = max(1, total_steps // 50)
    history = TrainHistory([], [], [], [], 0.0)
    progress = Progress("train", total_steps, "steps")
    start = time.monotonic()
    step = 0
    head.train()
    for epoch_batches in plan:
        for group in epoch_batches:
            # The cosine schedule runs to whichever end comes first: the last step or the time limit.
            done = step / total_steps
            if config.max_train_s is not None:
                done = max(done, (time.monotonic() - start) / config.max_train_s)
            scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
            for param_group in optimiser.param_groups:
                param_group["lr"] = config.learning_rate * max(scale, 0.02)
            parts = loss_of(head, make_batch(group), config)
            optimiser.zero_grad(set_to_none=True)
            parts.total.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            step += 1
            history.steps.append(step)
            history.train_loss.append(float(parts.total.detach()))
            history.train_distill.append(parts.distill)
            progress.advance(1, note=f"loss {history.train_loss[-1]:.3f} ce@1 {parts.distill[0]:.3f}")
            if config.max_train_s is not None and time.monotonic() - start > config.max_train_s:
                break
        if held_out:
            history.held_out_loss.append((step, held_out_loss(head, held_out, config)))
        if config.max_train_s is not None and time.monotonic() - start > config.max_train_s:
            break
    head.eval()
    progress.finish()
    return history._replace(seconds=time.monotonic() - start)


@torch.no_grad()
def held_out_loss(head: DraftHead, samples: Sequence[Sample], config: TrainConfig) -> float:
    losses = [float(loss_of(head, make_batch(g), config).total) * len(g)
              for g in _batches(samples, config.batch_tokens, shuffle=False, seed=0)]
    return sum(losses) / len(samples)
