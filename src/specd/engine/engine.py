"""The engine step, in the order the folder layout shows:

schedule -> propose -> verify (one target forward) -> rejection-sample -> commit / roll back KV
-> record stats -> stream.

Plain decoding is the same step with k_i = 0 for every sequence. Single-threaded: the server drives it from
its own thread and hands requests in through `add_request` / `abort_request` between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specd.config import EngineConfig
from specd.engine.outputs import RequestDelta, RequestTimings, TokenLogprob
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.sequence import SeqStatus, Sequence
from specd.errors import InvalidParameterError, PromptTooLongError, QueueFullError
from specd.metrics.stats import RequestSpecStats, SpecStatsRecorder, StatsSink, StepPhaseTimes
from specd.model.attention import ForwardBatch
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specd.sampling.params import SamplingParams
from specd.sampling.processing import build_sampling_batch, logits_to_probs
from specd.sampling.rejection import greedy_verify, rejection_sample
from specd.speculation.goodput import GoodputPlanner
from specd.speculation.k_policy import KPolicy
from specd.speculation.proposer import Proposal, Proposer, SequenceView

logger = logging.getLogger("specd.engine")


@dataclass(frozen=True, slots=True)
class StepResult:
    """Deltas of one step and how many sequences it ran (0: nothing to do)."""

    deltas: list[RequestDelta]
    num_scheduled: int


class LLMEngine:
    """Continuous-batching engine with speculation. Owns the model, KV cache, scheduler and proposer."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer | None,
        proposer: Proposer | None,
        stats_sinks: Seq[StatsSink] = (),
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        spec = config.speculation
        self.k_max = spec.num_speculative_tokens if (spec.enabled and proposer is not None) else 0
        self.policies = {name: KPolicy(name, spec.heuristic_probe_interval)
                         for name in ("fixed", "heuristic", "confidence", "goodput")}
        # The goodput policy's estimates (acceptance per match length, forward cost, throughput): engine-wide.
        self.goodput = GoodputPlanner() if (self.k_max and spec.method == "ngram") else None
        self.cache = model.make_cache(config.max_num_seqs, config.max_model_len)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.recorder = SpecStatsRecorder(spec.metrics_k_max, sinks=stats_sinks)
        self._seqs: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._pending: list[RequestDelta] = []
        self._rng = torch.Generator().manual_seed(config.seed)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Validate and queue a request. Raises InvalidParameterError / PromptTooLongError /
        QueueFullError naming the problem; nothing is queued then."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParameterError("request_id", "must be a non-empty string")
        if request_id in self._seqs:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params", "must be a SamplingParams")
        if self.queue_room() == 0:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidParameterError("prompt", "must be a non-empty string")
            if self.tokenizer is None:
                raise InvalidParameterError("prompt", "this engine has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        vocab = self.model.config.vocab_size
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidParameterError("prompt_token_ids", f"every token id must be an integer in [0, {vocab})")
        if len(prompt_token_ids) + 1 > self.config.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.config.max_model_len)
        k_max, policy = self._request_speculation(params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._rng).item()
        )
        seq = Sequence(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            generator=None if params.greedy else torch.Generator().manual_seed(seed),
            arrival_time=time.monotonic(),
            k_max=k_max,
            k_policy=policy,
            k_state=policy.initial(k_max),
            detokenizer=(
                IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_token_ids=prompt_token_ids
                )
                if self.tokenizer is not None else None
            ),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.config.max_model_len,
            logprobs=[] if params.logprobs is not None else None,
        )
        self._next_seq_id += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _request_speculation(self, params: SamplingParams) -> tuple[int, KPolicy]:
        engine_policy = self.policies[self.config.speculation.k_policy]
        override = params.speculation
        if override is None:
            return self.k_max, engine_policy
        if not override.enabled:
            return 0, engine_policy
        if self.k_max == 0 and (override.num_speculative_tokens or 0) > 0:
            raise InvalidParameterError("speculation", "this engine was started without speculation")
        k = self.k_max if override.num_speculative_tokens is None else override.num_speculative_tokens
        if k > self.k_max:
            raise InvalidParameterError(
                "speculation.num_speculative_tokens", f"must be <= the engine's k_max ({self.k_max})"
            )
        policy = engine_policy
        if override.k_policy == "goodput" and self.goodput is None:
            raise InvalidParameterError("speculation.k_policy", "'goodput' needs an engine speculating with ngram")
        if override.k_policy is not None and override.k_policy != engine_policy.name:
            if "confidence" in (override.k_policy, engine_policy.name):
                raise InvalidParameterError(
                    "speculation.k_policy",
                    f"'confidence' is set per engine (it is {engine_policy.name!r} here)",
                )
            policy = self.policies[override.k_policy]
        return k, policy

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its KV slot now. Returns False if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        self._pending.append(self._delta(seq, [], None))
        return True

    def queue_room(self) -> int | None:
        """How many more requests add_request accepts now (None = unbounded). Requests that will get a free
        slot at the next step do not count as waiting; max_waiting bounds the ones beyond that."""
        if not self.config.max_waiting:
            return None
        free = self.config.max_num_seqs - len(self.scheduler.running)
        return max(0, self.config.max_waiting + free - len(self.scheduler.waiting))

    def get_prompt_token_ids(self, request_id: str) -> list[int]:
        return list(self._seqs[request_id].prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---------------------------------------------------------------- step
    def step(self) -> StepResult:
        """Run one step; return the deltas of every request that changed (finished ones included)."""
        deltas, self._pending = self._pending, []
        wanted = {s.seq_id: s.k_state.k if s.k_max else 0 for s in self.scheduler.running}
        sched = self.scheduler.schedule(wanted)
        if sched.empty:
            return StepResult(deltas, 0)
        try:
            # _run appends as it commits, so a failure part-way keeps the deltas (final ones included) made so far.
            self._run(sched.scheduled, deltas)
        except Exception as exc:  # one bad step must not take the engine down: fail its requests only
            logger.exception("step failed; aborting the %d requests in it", len(sched.scheduled))
            for i, delta in enumerate(deltas):  # finished before the failure: their stats were not attached yet
                if delta.finished and delta.spec_stats is None:
                    deltas[i] = _with_stats(delta, self.recorder.finish_request(delta.request_id))
            for work in sched.scheduled:
                if not work.seq.finished:
                    self._finish(work.seq, "error")
                    deltas.append(self._delta(work.seq, [], None, error=f"{type(exc).__name__}: {exc}"))
        return StepResult(deltas, len(sched.scheduled))

    def _run(self, scheduled: list[ScheduledSeq], deltas: list[RequestDelta]) -> None:
        t0 = time.perf_counter()
        # Decode/verification-only steps feed goodput's cost and throughput estimates; prefill time is not what
        # drafting competes with.
        decode_only = not any(w.is_prefill for w in scheduled)
        drafts = self._propose([w for w in scheduled if not w.is_prefill and w.num_draft > 0])
        if self.goodput is not None:
            drafts = self._plan_goodput(scheduled, drafts)
        t1 = time.perf_counter()

        # Verify: one target forward over [last, d_1..d_k] of decoding sequences and prompt chunks.
        new_tokens: list[list[int]] = []
        logit_rows: list[list[int]] = []
        sampled: list[ScheduledSeq] = []
        for work in scheduled:
            seq = work.seq
            if work.is_prefill:
                start = seq.num_computed
                new_tokens.append(seq.prompt_token_ids[start : start + work.num_prefill])
                completes = start + work.num_prefill == len(seq.prompt_token_ids)
                logit_rows.append([work.num_prefill - 1] if completes else [])
                if completes:
                    sampled.append(work)
            else:
                d = drafts.token_ids.get(seq.seq_id, [])
                new_tokens.append([seq.last_token, *d])
                logit_rows.append(list(range(len(d) + 1)))
                sampled.append(work)
        batch = ForwardBatch.build(
            new_tokens, [w.seq.slot or 0 for w in scheduled], [w.seq.num_computed for w in scheduled], logit_rows
        )
        self.cache.reserve(max(w.seq.num_computed + len(t) for w, t in zip(scheduled, new_tokens)))
        logits = self.model(batch, self.cache)  # [num_logit_rows, vocab_size]
        t2 = time.perf_counter()

        # Rejection-sample every sequence that has logits (k_i = 0 is plain sampling).
        num_draft = [len(drafts.token_ids.get(w.seq.seq_id, [])) if not w.is_prefill else 0 for w in sampled]
        rows_per_seq = [k + 1 for k in num_draft]
        draft_list = [t for w in sampled if not w.is_prefill for t in drafts.token_ids.get(w.seq.seq_id, [])]
        if drafts.probs is None and all(w.seq.params.greedy for w in sampled):
            # The common greedy case: the same decision without [rows, vocab_size] distributions.
            result = greedy_verify(logits, draft_list, num_draft)
        else:
            sampling = build_sampling_batch([w.seq.params for w in sampled], rows_per_seq, logits.device)
            probs = logits_to_probs(logits, sampling)  # [num_logit_rows, vocab_size]
            result = rejection_sample(
                probs, torch.tensor(draft_list, dtype=torch.long), drafts.probs, num_draft,
                [w.seq.generator for w in sampled],
            )
        t3 = time.perf_counter()
        if self.goodput is not None and decode_only:
            # What a draft token costs: its share of the forward and of verification, measured together.
            self.goodput.observe_forward(sum(batch.num_new_tokens), t3 - t1)

        # Commit: keep what the stop rules allow, roll KV back to exactly the kept tokens.
        first_delta = len(deltas)
        counts: list[tuple[int, int, int]] = []
        row = 0
        for i, work in enumerate(sampled):
            seq = work.seq
            out_tokens = result.output_token_ids[i]
            lps = self._logprobs(logits, row, out_tokens, seq.params.logprobs)
            row += rows_per_seq[i]
            if work.is_prefill:
                seq.num_computed += work.num_prefill
            emitted = seq.append_tokens(out_tokens, lps)
            # The cache keeps every token but the newest: last + accepted drafts that were kept.
            seq.num_computed = seq.num_tokens - 1
            self.cache.set_len(seq.slot or 0, seq.num_computed)
            counts.append((num_draft[i], result.num_accepted[i], emitted))
            if self.goodput is not None and num_draft[i]:
                self.goodput.observe_draft(
                    seq.seq_id, drafts.buckets.get(seq.seq_id, 0), num_draft[i], result.num_accepted[i]
                )
            if seq.k_max:
                seq.k_state = seq.k_policy.update(seq.k_state, seq.k_max, num_draft[i], result.num_accepted[i])
            seq.num_steps += 1
            if seq.first_token_time is None and emitted:
                seq.first_token_time = time.monotonic()
            new = seq.output_token_ids[len(seq.output_token_ids) - emitted :]
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
            deltas.append(self._delta(seq, new, seq.logprobs[-emitted:] if seq.logprobs and emitted else None))
        sampled_ids = {w.seq.seq_id for w in sampled}
        for work in scheduled:
            if work.is_prefill and work.seq.seq_id not in sampled_ids:
                work.seq.num_computed += work.num_prefill
                self.cache.set_len(work.seq.slot or 0, work.seq.num_computed)
                work.seq.num_steps += 1

        if self.goodput is not None and decode_only:
            self.goodput.observe_step(sum(c[2] for c in counts), time.perf_counter() - t0)
        if sampled:
            ids = [w.seq.request_id for w in sampled]
            counts_t = torch.tensor(counts, dtype=torch.long).T  # [3, num_sampled]: k_i, a_i, e_i
            detail = {w.seq.request_id for w in sampled if w.seq.params.spec_detail}
            self.recorder.record_step(ids, counts_t, StepPhaseTimes(t1 - t0, t2 - t1, t3 - t2), detail)
            # Finished requests: their final delta carries the final per-request stats.
            for i, w in enumerate(sampled):
                if w.seq.finished:
                    deltas[first_delta + i] = _with_stats(
                        deltas[first_delta + i], self.recorder.finish_request(w.seq.request_id)
                    )

    # ------------------------------------------------------------- helpers
    def _propose(self, decoding: list[ScheduledSeq]) -> _Drafts:
        if not decoding or self.proposer is None:
            return _Drafts({}, None, {})
        views = [SequenceView(w.seq.seq_id, w.seq.token_ids, w.seq.params, w.seq.generator) for w in decoding]
        proposal: Proposal = self.proposer.propose(views, [w.num_draft for w in decoding])
        token_ids = {}
        vocab = self.model.config.vocab_size
        for w, d in zip(decoding, proposal.draft_token_ids, strict=True):
            if len(d) > w.num_draft:
                raise RuntimeError(f"proposer returned {len(d)} drafts for k_i = {w.num_draft}")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in d):
                # Checked here, at the boundary: a -1 placeholder would otherwise index the vocabulary from the end.
                raise RuntimeError(
                    f"proposer {type(self.proposer).__name__} returned draft token ids outside [0, {vocab}): {d}"
                )
            token_ids[w.seq.seq_id] = list(d)
        buckets = proposal.draft_buckets if proposal.draft_buckets is not None else [0] * len(decoding)
        if len(buckets) != len(decoding):
            raise RuntimeError(f"proposer returned {len(buckets)} draft buckets for {len(decoding)} sequences")
        return _Drafts(token_ids, proposal.draft_probs, {w.seq.seq_id: b for w, b in zip(decoding, buckets)})

    def _plan_goodput(self, scheduled: list[ScheduledSeq], drafts: _Drafts) -> _Drafts:
        """Shorten the drafts of goodput-policy sequences to what pays for its verification (a prefix each)."""
        assert self.goodput is not None
        planned = [w.seq.seq_id for w in scheduled if not w.is_prefill and w.seq.k_policy.name == "goodput"
                   and drafts.token_ids.get(w.seq.seq_id)]
        if not planned:
            return drafts
        planned_set = set(planned)
        base = sum(  # the step's new tokens besides the drafts being planned
            w.num_prefill if w.is_prefill
            else 1 + (0 if w.seq.seq_id in planned_set else len(drafts.token_ids.get(w.seq.seq_id, [])))
            for w in scheduled
        )
        plan = self.goodput.plan(
            planned, [drafts.buckets.get(i, 0) for i in planned], [len(drafts.token_ids[i]) for i in planned], base
        )
        kept = dict(zip(planned, plan.keep))
        token_ids = {sid: (d[: kept[sid]] if sid in kept else d) for sid, d in drafts.token_ids.items()}
        probs = drafts.probs
        if probs is not None:  # keep the rows of the kept draft tokens (proposal order = dict order)
            rows: list[int] = []
            offset = 0
            for sid, d in drafts.token_ids.items():
                rows.extend(range(offset, offset + len(token_ids[sid])))
                offset += len(d)
            probs = probs[torch.tensor(rows, dtype=torch.long)]
        return _Drafts(token_ids, probs, drafts.buckets)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, row: int, tokens: list[int], top_n: int | None
    ) -> list[TokenLogprob] | None:
        if top_n is None:
            return None
        lp = torch.log_softmax(logits[row : row + len(tokens)].float(), dim=-1)  # [num_tokens, vocab_size]
        chosen = lp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
        if top_n > 0:
            values, indices = lp.topk(top_n, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        if self.goodput is not None:
            self.goodput.release(seq.seq_id)
        del self._seqs[seq.request_id]

    def _delta(
        self, seq: Sequence, new_tokens: list[int], new_logprobs: list[TokenLogprob] | None,
        error: str | None = None,
    ) -> RequestDelta:
        stats: RequestSpecStats | None = None
        if seq.finished and seq.finish_reason in ("abort", "error"):
            stats = self.recorder.finish_request(seq.request_id)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=seq.take_text_delta(),
            new_logprobs=new_logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason if seq.finished else None,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            spec_stats=stats,
            error=error,
            timings=self.timings(seq) if seq.finished else None,
        )

    def timings(self, seq: Sequence) -> RequestTimings:
        return RequestTimings(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_steps)


@dataclass(frozen=True, slots=True)
class _Drafts:
    token_ids: dict[int, list[int]]  # seq_id -> drafts
    probs: torch.Tensor | None  # [total_drafts, vocab_size] in proposal order, or None
    buckets: dict[int, int]  # seq_id -> the proposer's confidence class of its draft (0 when it gives none)


def _with_stats(delta: RequestDelta, stats: RequestSpecStats) -> RequestDelta:
    from dataclasses import replace

    return replace(delta, spec_stats=stats)
