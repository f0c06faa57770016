"""Continuous batching: which sequences run this step, with how many new tokens each.

Decoding sequences go first (1 + k_i tokens each: the last committed token plus up to k_i drafts), so a
long prompt never stalls running decodes; prompts are then prefilled in chunks with whatever is left of the
step's token budget. Requests join at step boundaries when a KV slot is free and leave when finished or
aborted. The batch is ordered by KV slot so attention reads the cache as a view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specd.engine.sequence import SeqStatus, Sequence
from specd.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True, eq=False)
class ScheduledSeq:
    """One sequence's work this step: a prefill chunk of `num_prefill` prompt tokens, or a decode asking
    for `num_draft` draft tokens (0 = plain decode)."""

    seq: Sequence
    num_prefill: int
    num_draft: int

    @property
    def is_prefill(self) -> bool:
        return self.num_prefill > 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # ordered by KV slot

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running set; the engine owns everything else."""

    def __init__(self, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its KV slot."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        """Move waiting requests into the running set while a slot is free. Called before k is planned, so the
        plan sees the prompts this step will prefill; `schedule` calls it too (a no-op then)."""
        while self.waiting and len(self.running) < self.max_num_seqs and self.cache.num_free_slots > 0:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def prompts_left(self) -> tuple[int, int]:
        """(running sequences still prefilling, prompt tokens they have left to prefill)."""
        prefilling = [s for s in self.running if s.is_prefilling]
        return len(prefilling), sum(len(s.prompt_token_ids) - s.num_computed for s in prefilling)

    def schedule(self, wanted_draft: dict[int, int]) -> SchedulerOutput:
        """Pick this step's work. wanted_draft[seq_id] is the k_i the policy asks for a decoding sequence;
        it is cut so the sequence cannot draft past max_tokens / max_model_len or the step's budget."""
        self.admit()
        budget = self.max_num_batched_tokens
        work: list[ScheduledSeq] = []
        # Every decoding sequence gets its one token first (EngineConfig guarantees the budget covers them),
        # then draft tokens are handed out from what is left, so a tight budget shrinks k instead of starving
        # some sequences. While prompts wait to be prefilled, drafts may take at most half of what is left,
        # so speculation never stalls admission.
        decoding = [s for s in self.running if not s.is_prefilling][:budget]
        budget -= len(decoding)
        prefill_pending = any(s.is_prefilling for s in self.running)
        draft_budget = budget // 2 if prefill_pending else budget
        for seq in decoding:
            # With k drafts up to k + 1 tokens are emitted; drafting more than can be kept is waste.
            k = max(0, min(wanted_draft.get(seq.seq_id, 0), seq.max_new_this_step() - 1, draft_budget))
            work.append(ScheduledSeq(seq, 0, k))
            draft_budget -= k
            budget -= k
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                chunk = min(len(seq.prompt_token_ids) - seq.num_computed, budget)
                work.append(ScheduledSeq(seq, chunk, 0))
                budget -= chunk
        work.sort(key=lambda w: w.seq.slot if w.seq.slot is not None else -1)
        return SchedulerOutput(work)
