"""The engine step, one call per job, in the order the folder layout shows:

schedule -> propose -> plan k -> run (one target forward) -> verify -> commit / roll back KV -> record -> stream.

Plain decoding is the same step with k_i = 0 for every sequence. Proposing and planning k are the speculator's
(engine/speculator.py), which knows proposers and k policies only through their protocols and never branches on
which one it has; the forward is the model runner's (engine/runner.py). Single-threaded: the server drives it
from its own thread and hands requests in through `add_request` / `abort_request` between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specd.config import EngineConfig
from specd.engine.constraints import Constraints
from specd.engine.outputs import FinishReason, RequestDelta, RequestTimings, TokenLogprob
from specd.engine.runner import ModelRunner, RunOutput
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.sequence import Prompt, SeqStatus, Sequence
from specd.engine.speculator import Drafts, Speculator
from specd.errors import InvalidParameterError, PromptTooLongError, QueueFullError
from specd.metrics.records import K0Cause
from specd.metrics.stats import SpecStatsRecorder, StatsSink, StepPhaseTimes
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specd.sampling.params import SamplingParams
from specd.sampling.penalties import TokenHistory, adjust_logits
from specd.sampling.rejection import RejectionResult, verify
from specd.speculation.k_policy import DraftOutcome, EngineLoad, StepReport
from specd.speculation.proposer import Proposer
from specd.threads import ThreadGovernor, max_threads

logger = logging.getLogger("specd.engine")


@dataclass(frozen=True, slots=True)
class StepResult:
    """Deltas of one step and how many sequences it ran (0: nothing to do)."""

    deltas: list[RequestDelta]
    num_scheduled: int


@dataclass(frozen=True, slots=True)
class _Committed:
    """One sampled sequence after commit: what it emitted this step and what verification did with its draft."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    outcome: DraftOutcome
    num_emitted: int


@dataclass(slots=True)
class _StepProgress:
    """What a step has done so far, kept as it goes so that a failure part-way loses nothing already committed."""

    started: float
    decode_only: bool
    num_prefill_tokens: int
    num_seqs: int = 0
    # Draft accounting for the recorder, seq_id -> value: k0 causes decided at scheduling, draft tokens proposed,
    # and kept by the k policies (before a grammar cut).
    schedule_k0_causes: dict[int, K0Cause] = field(default_factory=dict)
    num_proposed: dict[int, int] = field(default_factory=dict)
    num_kept: dict[int, int] = field(default_factory=dict)
    after_prompt: bool = False  # the previous step carried prompt chunks, or there was none (StepReport's)
    num_draft_forwards: int = 0  # what drafting cost, as the proposer reported it
    num_computed_draft_tokens: int = 0
    proposed: float = 0.0
    forward_done: float = 0.0
    verified: float = 0.0
    num_new_tokens: int = 0
    committed: list[_Committed] = field(default_factory=list)


class LLMEngine:
    """Continuous-batching engine with speculation. Owns the scheduler, the model runner, the speculator (proposer
    and k policies) and the stats recorder, and calls them in order each step."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer | None,
        proposer: Proposer | None,
        stats_sinks: Seq[StatsSink] = (),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.speculator = Speculator(config.speculation, proposer, model.config.vocab_size)
        # The target's KV cache: the scheduler hands out its slots, the runner writes and commits it.
        self.cache = model.make_cache(config.max_num_seqs, config.max_model_len)
        self.runner = ModelRunner(model, self.cache, self.speculator.hidden_layers)
        self.constraints = Constraints(tokenizer, model.config.vocab_size)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.recorder = SpecStatsRecorder(config.speculation.metrics_k_max, sinks=stats_sinks)
        # The threads of this engine's forwards, set on whichever thread steps it (specd/threads.py).
        self.threads = ThreadGovernor(max_threads(config.num_threads), config.thread_policy)
        self._seqs: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._pending: list[RequestDelta] = []
        self._rng = torch.Generator().manual_seed(config.seed)
        self._last_decode_only = False  # whether the last step that ran carried no prompt chunk
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

    # ------------------------------------------------------------ requests
    def make_prompt(self, text: str | None, token_ids: Seq[int] | None = None) -> Prompt:
        """Tokenize (unless token_ids are given) and validate a prompt, once: non-empty, every id in the
        vocabulary, and room for at least one generated token within max_model_len. Raises
        InvalidParameterError / PromptTooLongError naming the field."""
        if token_ids is None:
            if not isinstance(text, str) or not text:
                raise InvalidParameterError("prompt", "must be a non-empty string")
            if self.tokenizer is None:
                raise InvalidParameterError("prompt", "this engine has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer.encode(text)
        vocab, _ = self._prompt_limits
        if not token_ids:
            raise InvalidParameterError("prompt", "must not be empty")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise InvalidParameterError("prompt_token_ids", f"every token id must be an integer in [0, {vocab})")
        if len(token_ids) + 1 > self.config.max_model_len:
            raise PromptTooLongError(len(token_ids), self.config.max_model_len)
        return Prompt(text, list(token_ids), self._prompt_limits)

    @property
    def _prompt_limits(self) -> tuple[int, int]:
        return self.runner.model.config.vocab_size, self.config.max_model_len

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request. A prompt from `make_prompt` is taken as is; any other is validated first. Raises
        InvalidParameterError / PromptTooLongError / QueueFullError naming the problem; nothing is queued then."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParameterError("request_id", "must be a non-empty string")
        if request_id in self._seqs:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        if not isinstance(prompt, Prompt):
            raise InvalidParameterError("prompt", "must be a Prompt")
        if prompt.checked_against != self._prompt_limits:
            prompt = self.make_prompt(prompt.text, prompt.token_ids)
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params", "must be a SamplingParams")
        vocab, _ = self._prompt_limits
        if params.logit_bias and any(token >= vocab for token in params.logit_bias):
            raise InvalidParameterError("logit_bias", f"every token id must be in [0, {vocab})")
        if self.queue_room() == 0:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        grammar = self.constraints.compile(params)
        k_max, policy = self.speculator.request_policy(params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._rng).item()
        )
        seq = Sequence(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt=prompt.text,
            prompt_token_ids=list(prompt.token_ids),
            params=params,
            generator=None if params.greedy else torch.Generator().manual_seed(seed),
            arrival_time=time.monotonic(),
            k_max=k_max,
            k_policy=policy,
            detokenizer=(
                IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                    prompt_token_ids=prompt.token_ids,
                )
                if self.tokenizer is not None else None
            ),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.config.max_model_len,
            logprobs=[] if params.logprobs is not None else None,
            grammar=grammar,
        )
        self._next_seq_id += 1
        self._seqs[request_id] = seq
        if policy is not None:
            policy.add(seq.seq_id, k_max)
        self.scheduler.add(seq)

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
        capacity = self.queue_capacity()
        if capacity is None:
            return None
        return max(0, capacity - len(self.scheduler.running) - len(self.scheduler.waiting))

    def queue_capacity(self) -> int | None:
        """queue_room() of an idle engine: every slot free plus max_waiting (None = unbounded)."""
        if not self.config.max_waiting:
            return None
        return self.config.max_num_seqs + self.config.max_waiting

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
        """Run one step; return the deltas of every request that changed (finished ones included).

        One bad step must not take the engine down: if a job fails, what was committed before the failure is
        kept (and streamed), and the step's other requests finish with "error".
        """
        deltas, self._pending = self._pending, []
        # Admit first, so k is planned for the step as the scheduler will form it: its prompt chunks included.
        self.scheduler.admit()
        num_prefilling, num_prompt_tokens = self.scheduler.prompts_left()
        load = EngineLoad(self.num_running, self.num_waiting, self.config.max_num_batched_tokens,
                          num_prefilling, num_prompt_tokens)
        decoding = [seq for seq in self.scheduler.running if not seq.is_prefilling]
        wanted = self.speculator.wanted_k(decoding, load)
        scheduled = self.scheduler.schedule(wanted).scheduled
        if not scheduled:
            return StepResult(deltas, 0)
        num_prefill_tokens = sum(w.num_prefill for w in scheduled)
        progress = _StepProgress(time.perf_counter(), not num_prefill_tokens, num_prefill_tokens, len(scheduled),
                                 _schedule_k0_causes(scheduled, wanted), after_prompt=not self._last_decode_only)
        self._last_decode_only = progress.decode_only
        error: Exception | None = None
        self.threads.adjust()
        try:
            self._run(scheduled, progress)
            self._record(progress)
        except Exception as exc:
            logger.exception("step failed; aborting the %d requests in it", len(scheduled))
            error = exc
        finally:
            self.threads.finished()
        for done in progress.committed:
            if done.seq.finish_reason is not None:
                self._finish(done.seq, done.seq.finish_reason)
            deltas.append(self._delta(done.seq, done.new_token_ids, done.new_logprobs))
        if error is not None:
            for work in scheduled:
                if not work.seq.finished:
                    self._finish(work.seq, "error")
                    deltas.append(self._delta(work.seq, [], None, error=f"{type(error).__name__}: {error}"))
        return StepResult(deltas, len(scheduled))

    def _run(self, scheduled: list[ScheduledSeq], progress: _StepProgress) -> None:
        drafts = self.speculator.propose(scheduled)
        progress.num_proposed = {sid: len(d) for sid, d in drafts.token_ids.items()}
        progress.num_draft_forwards = drafts.num_forwards
        progress.num_computed_draft_tokens = drafts.num_computed_tokens
        proposed = drafts
        drafts = self.speculator.plan(scheduled, drafts, self.config.max_num_batched_tokens)
        progress.num_kept = {sid: len(d) for sid, d in drafts.token_ids.items()}
        drafts = self.constraints.cut_drafts({w.seq.seq_id: w.seq for w in scheduled}, drafts)
        drafts = Speculator.cut_next(proposed, drafts)
        progress.proposed = time.perf_counter()
        run = self.runner.run(scheduled, drafts.token_ids)
        progress.num_new_tokens = run.num_new_tokens
        progress.forward_done = time.perf_counter()
        result = self._verify(scheduled, run, drafts)
        progress.verified = time.perf_counter()
        self._commit(scheduled, run, drafts, result, progress)
        emitted = {done.seq.seq_id: done.num_emitted for done in progress.committed}
        self.speculator.observe_hidden_states(scheduled, run, emitted)

    # -------------------------------------------------------- step: the jobs
    def _verify(self, scheduled: list[ScheduledSeq], run: RunOutput, drafts: Drafts) -> RejectionResult:
        """verify: accept a prefix of each sampled sequence's draft and sample one more token (k_i = 0: plain
        sampling)."""
        seqs = [scheduled[index].seq for index in run.sampled]
        per_seq = [drafts.token_ids.get(seq.seq_id, []) for seq in seqs]  # prompt chunks have none
        params = [s.params for s in seqs]
        # Penalties and logit_bias: row j of a sequence counts its drafts d_1..d_j as already generated.
        scored = adjust_logits(
            run.logits, params, run.rows_per_sampled,
            [TokenHistory(s.prompt_token_ids, s.output_token_ids) for s in seqs], per_seq,
        )  # [num_logit_rows, vocab_size]; run.logits stays raw for logprobs
        scored = self.constraints.mask(scored, seqs, per_seq, run.rows_per_sampled)  # structured outputs
        return verify(scored, per_seq, drafts.probs, params, [s.generator for s in seqs])

    def _commit(
        self, scheduled: list[ScheduledSeq], run: RunOutput, drafts: Drafts, result: RejectionResult,
        progress: _StepProgress,
    ) -> None:
        """commit: keep what the stop rules allow and roll the KV cache back to exactly the kept tokens."""
        row = 0
        for i, index in enumerate(run.sampled):
            work = scheduled[index]
            seq = work.seq
            out_tokens = result.output_token_ids[i]
            logprobs = self.runner.logprobs(run.logits, row, out_tokens, seq.params.logprobs)
            row += run.rows_per_sampled[i]
            if work.is_prefill:
                seq.num_computed += work.num_prefill
            emitted = seq.append_tokens(out_tokens, logprobs)
            self.constraints.advance(seq, seq.output_token_ids[len(seq.output_token_ids) - emitted :])
            # The cache keeps every token but the newest: last + accepted drafts that were kept.
            seq.num_computed = seq.num_tokens - 1
            self.runner.commit(seq.slot or 0, seq.num_computed)
            seq.num_steps += 1
            if seq.first_token_time is None and emitted:
                seq.first_token_time = time.monotonic()
            num_drafted, num_accepted = run.rows_per_sampled[i] - 1, result.num_accepted[i]
            cut_next = drafts.cut_next.get(seq.seq_id)
            # The target's token after the accepted drafts, against the draft token that was cut there.
            next_matched = (None if cut_next is None or num_accepted < num_drafted
                            else out_tokens[num_accepted] == cut_next)
            progress.committed.append(_Committed(
                seq,
                seq.output_token_ids[len(seq.output_token_ids) - emitted :],
                seq.logprobs[-emitted:] if seq.logprobs and emitted else None,
                DraftOutcome(seq.seq_id, num_drafted, num_accepted, drafts.buckets.get(seq.seq_id, 0), next_matched),
                emitted,
            ))
        sampled = set(run.sampled)
        for index, work in enumerate(scheduled):
            if index not in sampled:  # a prompt chunk that does not finish its prompt
                work.seq.num_computed += work.num_prefill
                self.runner.commit(work.seq.slot or 0, work.seq.num_computed)
                work.seq.num_steps += 1

    def _record(self, progress: _StepProgress) -> None:
        """record: the step's counts to the stats recorder and its outcome and cost to every k policy (a step that
        only prefilled prompt chunks is recorded too, with no sequences; k policies see steps that sampled)."""
        committed = progress.committed
        # One forward ran the prompt chunks and the verified rows together: its time is split by token share.
        forward_s = progress.forward_done - progress.proposed
        prefill_share = progress.num_prefill_tokens / progress.num_new_tokens if progress.num_new_tokens else 0.0
        times = StepPhaseTimes(
            progress.proposed - progress.started,
            forward_s * (1.0 - prefill_share),
            progress.verified - progress.forward_done,
            forward_s * prefill_share,
        )
        if not committed:
            self.recorder.record_counts([], [], [], [], times, num_prefill_tokens=progress.num_prefill_tokens)
            return
        report = StepReport(
            outcomes=[done.outcome for done in committed],
            num_new_tokens=progress.num_new_tokens,
            verify_s=progress.verified - progress.proposed,
            step_s=time.perf_counter() - progress.started,
            num_emitted=sum(done.num_emitted for done in committed),
            decode_only=progress.decode_only,
            propose_s=progress.proposed - progress.started,
            num_seqs=progress.num_seqs,
            after_prompt=progress.after_prompt,
        )
        self.speculator.observe(report)
        num_proposed = [progress.num_proposed.get(done.seq.seq_id, 0) for done in committed]
        self.recorder.record_counts(
            [done.seq.request_id for done in committed],
            [done.outcome.num_drafted for done in committed],
            [done.outcome.num_accepted for done in committed],
            [done.num_emitted for done in committed],
            times,
            {done.seq.request_id for done in committed if done.seq.params.spec_detail},
            progress.num_prefill_tokens,
            num_proposed,
            [progress.num_kept.get(done.seq.seq_id, 0) - done.outcome.num_drafted for done in committed],
            [_k0_cause(done, progress) for done in committed],
            progress.num_draft_forwards,
            progress.num_computed_draft_tokens,
        )

    # ------------------------------------------------------------- helpers
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence: free its KV slot and everything proposer and k policies keep for it."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)
        self.speculator.release(seq.seq_id)
        del self._seqs[seq.request_id]

    def _delta(
        self, seq: Sequence, new_tokens: list[int], new_logprobs: list[TokenLogprob] | None,
        error: str | None = None,
    ) -> RequestDelta:
        """The request's delta; a finished request's final delta carries its final spec stats (the one place they
        are attached, after the request's last step was recorded)."""
        finished = seq.finished
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=seq.take_text_delta(),
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            spec_stats=self.recorder.finish_request(seq.request_id, seq.finish_reason) if finished else None,
            error=error,
            timings=self.timings(seq) if finished else None,
        )

    def timings(self, seq: Sequence) -> RequestTimings:
        return RequestTimings(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_steps)


def _schedule_k0_causes(scheduled: list[ScheduledSeq], wanted: dict[int, int]) -> dict[int, K0Cause]:
    """Why sequences got k = 0 before proposing: their first token, no policy, or the scheduler's cut (their
    remaining max_tokens / max_model_len, else the step's token budget). Read before the step changes them."""
    causes: dict[int, K0Cause] = {}
    for work in scheduled:
        seq = work.seq
        if work.is_prefill:
            causes[seq.seq_id] = "first_token"  # only read if the chunk completes the prompt and samples
        elif work.num_draft == 0:
            if seq.k_policy is None:
                causes[seq.seq_id] = "disabled"
            elif wanted.get(seq.seq_id, 0) == 0:
                causes[seq.seq_id] = "policy"
            else:
                causes[seq.seq_id] = "max_tokens" if seq.max_new_this_step() <= 1 else "budget"
    return causes


def _k0_cause(done: _Committed, progress: _StepProgress) -> K0Cause:
    """The first stage of the step's pipeline that left this sequence with no draft token to verify (docs/metrics.md,
    "Why k = 0"); only read by the recorder when k_i = 0."""
    seq_id = done.seq.seq_id
    cause = progress.schedule_k0_causes.get(seq_id)
    if cause is not None:
        return cause
    if progress.num_proposed.get(seq_id, 0) == 0:
        return "no_match"
    if progress.num_kept.get(seq_id, 0) == 0:
        return "policy"
    return "grammar"
