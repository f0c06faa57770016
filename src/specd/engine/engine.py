"""The engine step, one call per job, in the order the folder layout shows:

schedule -> propose -> plan k -> run (one target forward) -> verify -> commit / roll back KV -> record -> stream.

Plain decoding is the same step with k_i = 0 for every sequence. The engine knows proposers and k policies only
through their protocols (speculation/proposer.py, speculation/k_policy.py) and never branches on which one it
has. Single-threaded: the server drives it from its own thread and hands requests in through `add_request` /
`abort_request` between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specd.config import EngineConfig
from specd.engine.outputs import FinishReason, RequestDelta, RequestTimings, TokenLogprob
from specd.engine.runner import ModelRunner, RunOutput
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.sequence import Prompt, SeqStatus, Sequence
from specd.errors import InvalidParameterError, PromptTooLongError, QueueFullError
from specd.metrics.stats import SpecStatsRecorder, StatsSink, StepPhaseTimes
from specd.model.llama import LlamaForCausalLM
from specd.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specd.sampling.params import SamplingParams
from specd.sampling.rejection import RejectionResult, verify
from specd.speculation.k_policy import DraftOutcome, DraftSpan, EngineLoad, KPolicy, StepReport, StepView
from specd.speculation.proposer import Proposer, SequenceView
from specd.speculation.registry import build_k_policies, k_policy_unsupported

logger = logging.getLogger("specd.engine")


@dataclass(frozen=True, slots=True)
class StepResult:
    """Deltas of one step and how many sequences it ran (0: nothing to do)."""

    deltas: list[RequestDelta]
    num_scheduled: int


@dataclass(frozen=True, slots=True)
class _Drafts:
    token_ids: dict[int, list[int]]  # seq_id -> drafts
    probs: torch.Tensor | None  # [total_drafts, vocab_size] in proposal order, or None
    buckets: dict[int, int]  # seq_id -> the proposer's own class of its draft (0 when it gives none)


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
    proposed: float = 0.0
    forward_done: float = 0.0
    verified: float = 0.0
    num_new_tokens: int = 0
    committed: list[_Committed] = field(default_factory=list)


class LLMEngine:
    """Continuous-batching engine with speculation. Owns the scheduler, the model runner, the proposer and the k
    policies, and calls them in order each step."""

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
        self.proposer = proposer
        spec = config.speculation
        self.k_max = spec.num_speculative_tokens if (spec.enabled and proposer is not None) else 0
        # Every k policy the proposer supports, by name: the engine's own and the ones a request may choose.
        self.k_policies: dict[str, KPolicy] = {}
        if proposer is not None and self.k_max:
            self.k_policies = build_k_policies(spec, proposer.traits)
            if spec.k_policy not in self.k_policies:
                raise InvalidParameterError(
                    "speculation.k_policy",
                    f"{spec.k_policy!r} does not work with {type(proposer).__name__}: "
                    f"{k_policy_unsupported(spec.k_policy, proposer.traits)}",
                )
        # The target's KV cache: the scheduler hands out its slots, the runner writes and commits it.
        self.cache = model.make_cache(config.max_num_seqs, config.max_model_len)
        self.runner = ModelRunner(model, self.cache, proposer.hidden_layers if proposer is not None else None)
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
        if self.queue_room() == 0:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        k_max, policy = self._request_speculation(params)
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
        )
        self._next_seq_id += 1
        self._seqs[request_id] = seq
        if policy is not None:
            policy.add(seq.seq_id, k_max)
        self.scheduler.add(seq)

    def _request_speculation(self, params: SamplingParams) -> tuple[int, KPolicy | None]:
        """The request's k_max and k policy: the engine's, or what its SpecOverride asks within them."""
        k_max = self.k_max
        name = self.config.speculation.k_policy
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
            traits = self.proposer.traits if self.proposer is not None else None
            reason = k_policy_unsupported(name, traits) if traits is not None else "no proposer"
            raise InvalidParameterError("speculation.k_policy", f"{name!r} does not work with this engine: {reason}")
        return k_max, policy

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
        """Run one step; return the deltas of every request that changed (finished ones included).

        One bad step must not take the engine down: if a job fails, what was committed before the failure is
        kept (and streamed), and the step's other requests finish with "error".
        """
        deltas, self._pending = self._pending, []
        scheduled = self.scheduler.schedule(self._wanted_k()).scheduled
        if not scheduled:
            return StepResult(deltas, 0)
        progress = _StepProgress(time.perf_counter(), decode_only=not any(w.is_prefill for w in scheduled))
        error: Exception | None = None
        try:
            self._run(scheduled, progress)
            self._record(progress)
        except Exception as exc:
            logger.exception("step failed; aborting the %d requests in it", len(scheduled))
            error = exc
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
        drafts = self._propose(scheduled)
        drafts = self._plan_k(scheduled, drafts)
        progress.proposed = time.perf_counter()
        run = self.runner.run(scheduled, drafts.token_ids)
        progress.num_new_tokens = run.num_new_tokens
        progress.forward_done = time.perf_counter()
        result = self._verify(scheduled, run, drafts)
        progress.verified = time.perf_counter()
        self._commit(scheduled, run, drafts, result, progress)
        self._hand_hidden_states(scheduled, run, progress)

    # -------------------------------------------------------- step: the jobs
    def _wanted_k(self) -> dict[int, int]:
        """schedule's input: the k_i each running sequence's policy asks for (the scheduler may cut it)."""
        load = EngineLoad(self.num_running, self.num_waiting, self.config.max_num_batched_tokens)
        by_policy: dict[KPolicy, list[Sequence]] = {}
        for seq in self.scheduler.running:
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

    def _propose(self, scheduled: list[ScheduledSeq]) -> _Drafts:
        """propose: up to k_i drafts for every decoding sequence that was given k_i > 0."""
        decoding = [w for w in scheduled if not w.is_prefill and w.num_draft > 0]
        if not decoding or self.proposer is None:
            return _Drafts({}, None, {})
        views = [
            SequenceView(
                w.seq.seq_id, w.seq.token_ids, w.seq.params, w.seq.generator,
                w.seq.k_policy.draft_stop(w.seq.seq_id) if w.seq.k_policy is not None else None,
            )
            for w in decoding
        ]
        proposal = self.proposer.propose(views, [w.num_draft for w in decoding])
        name = type(self.proposer).__name__
        token_ids = {}
        vocab = self.runner.model.config.vocab_size
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
        return _Drafts(token_ids, proposal.draft_probs, {w.seq.seq_id: b for w, b in zip(decoding, buckets)})

    def _plan_k(self, scheduled: list[ScheduledSeq], drafts: _Drafts) -> _Drafts:
        """plan k: each policy keeps a prefix of its sequences' drafts, seeing the whole step."""
        by_policy: dict[KPolicy, list[int]] = {}
        for w in scheduled:
            if not w.is_prefill and w.seq.k_policy is not None and drafts.token_ids.get(w.seq.seq_id):
                by_policy.setdefault(w.seq.k_policy, []).append(w.seq.seq_id)
        if not by_policy:
            return drafts
        token_ids = dict(drafts.token_ids)
        for policy, seq_ids in by_policy.items():
            num_new_tokens = sum(w.num_prefill if w.is_prefill else 1 + len(token_ids.get(w.seq.seq_id, []))
                                 for w in scheduled)
            step = StepView(len(scheduled), num_new_tokens, self.config.max_num_batched_tokens,
                            decode_only=not any(w.is_prefill for w in scheduled))
            spans = [DraftSpan(sid, len(token_ids[sid]), drafts.buckets.get(sid, 0)) for sid in seq_ids]
            keep = policy.keep(spans, step)
            for span, kept in zip(spans, keep, strict=True):
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
        return _Drafts(token_ids, probs, drafts.buckets)

    def _verify(self, scheduled: list[ScheduledSeq], run: RunOutput, drafts: _Drafts) -> RejectionResult:
        """verify: accept a prefix of each sampled sequence's draft and sample one more token (k_i = 0: plain
        sampling)."""
        seqs = [scheduled[index].seq for index in run.sampled]
        per_seq = [drafts.token_ids.get(seq.seq_id, []) for seq in seqs]  # prompt chunks have none
        return verify(run.logits, per_seq, drafts.probs, [s.params for s in seqs], [s.generator for s in seqs])

    def _commit(
        self, scheduled: list[ScheduledSeq], run: RunOutput, drafts: _Drafts, result: RejectionResult,
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
            # The cache keeps every token but the newest: last + accepted drafts that were kept.
            seq.num_computed = seq.num_tokens - 1
            self.runner.commit(seq.slot or 0, seq.num_computed)
            seq.num_steps += 1
            if seq.first_token_time is None and emitted:
                seq.first_token_time = time.monotonic()
            num_drafted = run.rows_per_sampled[i] - 1
            progress.committed.append(_Committed(
                seq,
                seq.output_token_ids[len(seq.output_token_ids) - emitted :],
                seq.logprobs[-emitted:] if seq.logprobs and emitted else None,
                DraftOutcome(seq.seq_id, num_drafted, result.num_accepted[i], drafts.buckets.get(seq.seq_id, 0)),
                emitted,
            ))
        sampled = set(run.sampled)
        for index, work in enumerate(scheduled):
            if index not in sampled:  # a prompt chunk that does not finish its prompt
                work.seq.num_computed += work.num_prefill
                self.runner.commit(work.seq.slot or 0, work.seq.num_computed)
                work.seq.num_steps += 1

    def _hand_hidden_states(self, scheduled: list[ScheduledSeq], run: RunOutput, progress: _StepProgress) -> None:
        """The target's features of the rows each still-running sequence kept, to a proposer that asked."""
        if self.proposer is None or run.hidden_states is None:
            return
        emitted = {done.seq.seq_id: done.num_emitted for done in progress.committed}
        seq_ids: list[int] = []
        starts: list[int] = []
        features: list[torch.Tensor] = []
        for index, work in enumerate(scheduled):
            seq = work.seq
            if seq.finish_reason is not None:
                continue  # finishing: the proposer releases it
            # A prompt chunk keeps all its rows; a decode keeps the rows behind the tokens it emitted.
            num_kept = work.num_prefill if work.is_prefill else emitted[seq.seq_id]
            offset = run.token_offsets[index]
            seq_ids.append(seq.seq_id)
            starts.append(run.start_positions[index])
            features.append(run.hidden_states[offset : offset + num_kept])  # [num_kept, num_features]
        if seq_ids:
            self.proposer.observe(seq_ids, starts, features)

    def _record(self, progress: _StepProgress) -> None:
        """record: the step's counts to the stats recorder and its outcome and cost to every k policy."""
        committed = progress.committed
        if not committed:
            return
        report = StepReport(
            outcomes=[done.outcome for done in committed],
            num_new_tokens=progress.num_new_tokens,
            verify_s=progress.verified - progress.proposed,
            step_s=time.perf_counter() - progress.started,
            num_emitted=sum(done.num_emitted for done in committed),
            decode_only=progress.decode_only,
        )
        for policy in self.k_policies.values():
            policy.observe(report)
        self.recorder.record_counts(
            [done.seq.request_id for done in committed],
            [done.outcome.num_drafted for done in committed],
            [done.outcome.num_accepted for done in committed],
            [done.num_emitted for done in committed],
            StepPhaseTimes(
                progress.proposed - progress.started,
                progress.forward_done - progress.proposed,
                progress.verified - progress.forward_done,
            ),
            {done.seq.request_id for done in committed if done.seq.params.spec_detail},
        )

    # ------------------------------------------------------------- helpers
    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence: free its KV slot and everything proposer and k policies keep for it."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        for policy in self.k_policies.values():  # any policy may hold estimates about any sequence
            policy.release(seq.seq_id)
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
            spec_stats=self.recorder.finish_request(seq.request_id) if finished else None,
            error=error,
            timings=self.timings(seq) if finished else None,
        )

    def timings(self, seq: Sequence) -> RequestTimings:
        return RequestTimings(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_steps)
