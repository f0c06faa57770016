"""The Python API in the shape users know from vLLM: `LLM(model="default").generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch

from specd.config import EngineConfig, SpeculationConfig
from specd.engine.engine import LLMEngine
from specd.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, RequestTimings, TokenLogprob
from specd.engine.scoring import prompt_logprobs
from specd.engine.sequence import Prompt
from specd.errors import InvalidParameterError
from specd.metrics.log_sink import PeriodicLogger
from specd.metrics.stats import StatsSink
from specd.metrics.trace import TraceSink
from specd.model.llama import LlamaForCausalLM, build_model
from specd.model.loader import load_checkpoint
from specd.model.memory import available_memory, check_fits, estimate_memory
from specd.model.tokenizer import Tokenizer
from specd.sampling.params import SamplingParams
from specd.speculation.proposer import Proposer
from specd.speculation.registry import build_proposer
from specd.threads import max_threads

__all__ = ["LLM", "EngineState", "Prompt"]

logger = logging.getLogger("specd")


class EngineState(NamedTuple):
    """The engine between steps: how many requests run and wait, and how the KV-cache slots are used."""

    num_running: int
    num_waiting: int
    kv_used_slots: int
    kv_free_slots: int
    num_in_line: int = 0  # the server's admission line (requests waiting for room in the queue); 0 here
    num_threads: int = 1  # CPU threads the engine's forwards run now (specd/threads.py)
    free_cpus: float | None = None  # cores other processes left free in the last window (None: not measured)


@dataclass(slots=True)
class _Accumulator:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class LLM:
    """Offline generation with continuous batching and speculation: the facade over the engine that the CLI and
    the server use too (they call only its public methods).

    `LLM(model="default", speculation=SpeculationConfig(method="ngram", k_policy="heuristic"))`. Any
    EngineConfig field can be passed as a keyword; `LLM.from_config` takes a whole EngineConfig. Use
    `LLM.from_model` to wrap an in-memory model (tests).
    """

    def __init__(
        self,
        model: str = "default",
        speculation: SpeculationConfig | None = None,
        stats_sinks: Sequence[StatsSink] = (),
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(model=model, speculation=speculation or SpeculationConfig(), **engine_kwargs)
        checkpoint = load_checkpoint(config.model, config.load_dtype)  # the header: weights are read when built
        estimate = estimate_memory(checkpoint.state_dict, checkpoint.config, config.torch_dtype, config.int4_weights,
                                   config.max_num_seqs, config.max_model_len)
        check_fits(estimate, available_memory(), checkpoint.source)
        # The load's own parallel work (repacking) on this thread: as many threads as the engine may run at most,
        # a container's CPU quota included, which OpenMP's default ignores. This also sets torch's default for
        # threads started later; the engine sets the count of the thread that steps it (specd/threads.py).
        torch.set_num_threads(max_threads(config.num_threads))
        target = build_model(
            checkpoint.config, checkpoint.state_dict, config.torch_dtype, max_positions=config.max_model_len,
            int4=config.int4_weights,
        )
        self.source = checkpoint.source
        self._init(config, target, checkpoint.tokenizer, stats_sinks)

    @classmethod
    def from_config(cls, config: EngineConfig, stats_sinks: Sequence[StatsSink] = ()) -> LLM:
        """Load config.model into an LLM with every EngineConfig field honoured."""
        if not isinstance(config, EngineConfig):
            raise InvalidParameterError("config", "must be an EngineConfig")
        kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("model", "speculation")}
        return cls(config.model, speculation=config.speculation, stats_sinks=stats_sinks, **kwargs)

    @classmethod
    def from_model(
        cls,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        stats_sinks: Sequence[StatsSink] = (),
        proposer: Proposer | None = None,
    ) -> LLM:
        """Wrap an in-memory model. `proposer` overrides the one the config would build (tests, plugins)."""
        self = cls.__new__(cls)
        self.source = "in-memory model"
        self._init(config, model, tokenizer, stats_sinks, proposer)
        return self

    def _init(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer | None,
        sinks: Sequence[StatsSink],
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        sinks = list(sinks)
        self._trace: TraceSink | None = None
        if config.spec_trace_path:
            self._trace = TraceSink(config.spec_trace_path, model=config.model, proposer=config.speculation.method,
                                    k_policy=config.speculation.k_policy)
            sinks.append(self._trace)
        if proposer is None and config.speculation.enabled:
            proposer = build_proposer(config, model, tokenizer)
        self.engine = LLMEngine(config, model, tokenizer, proposer, stats_sinks=sinks)
        # The log line runs on its own timer thread, so idle periods are logged as they pass, not after the next step.
        self._periodic = (
            PeriodicLogger(self.engine.recorder, config.log_stats_interval_s, logger)
            if config.log_stats_interval_s > 0 else None
        )
        if self._periodic is not None:
            self._periodic.start()
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the log-line timer (logging the partial last interval) and close the trace file. Stepping after
        close() still works; what the closed trace sink cannot write is counted in get_metrics()["sink_errors"]."""
        if self._periodic is not None:
            self._periodic.close()
        if self._trace is not None:
            self._trace.close()

    # ------------------------------------------------------------- stepping
    def step(self) -> list[RequestDelta]:
        """One engine step (the streaming interface): deltas of every request that changed."""
        deltas = self.engine.step().deltas
        if self._trace is not None and not self.engine.has_unfinished():
            self._trace.flush()
        return deltas

    def prompt(self, prompt: str | None, prompt_token_ids: Sequence[int] | None = None) -> Prompt:
        """Tokenize (unless token ids are given) and validate a prompt once; `add_request` then takes it as is.
        Raises InvalidParameterError / PromptTooLongError naming the field."""
        return self.engine.make_prompt(prompt, prompt_token_ids)

    def prompt_logprobs(self, prompt: Prompt, top_n: int = 0) -> list[TokenLogprob]:
        """Logprob of each prompt token after the ones before it (entry i is token i + 1), with top_n alternatives.

        One extra forward over the prompt in its own KV cache (specd.engine.scoring), safe beside the engine thread.
        """
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= 20:
            raise InvalidParameterError("logprobs", f"must be an integer in [0, 20], got {top_n!r}")
        return prompt_logprobs(self.model, prompt.token_ids, top_n)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> Prompt:
        """One conversation through the model's chat template, tokenized and validated like `prompt`."""
        if self.tokenizer is None:
            raise InvalidParameterError("messages", "this model has no tokenizer / chat template")
        # Roles are checked against the template, and control-token text inside message contents is encoded as
        # plain text (Tokenizer.render_chat); the template writes its own BOS.
        rendered = self.tokenizer.render_chat(messages)
        return self.prompt(rendered.text, rendered.token_ids)

    def add_request(
        self, prompt: str | Prompt | None, params: SamplingParams, prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request: a Prompt from `prompt()` / `chat_prompt()`, or text / token ids to make one from.
        Returns its request id."""
        if not isinstance(prompt, Prompt):
            prompt = self.prompt(prompt, prompt_token_ids)
        rid = request_id or f"req-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        return rid

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def queue_capacity(self) -> int | None:
        """The most requests add_request can hold at once (running + waiting) on an idle engine; a batch
        larger than this can never be added whole. None: no limit (max_waiting = 0)."""
        return self.engine.queue_capacity()

    def stream(self, prompt: str | Prompt | None, params: SamplingParams | None = None,
               prompt_token_ids: list[int] | None = None) -> Iterator[RequestDelta]:
        """Generate one request, yielding its deltas as they are produced."""
        rid = self.add_request(prompt, params or SamplingParams(), prompt_token_ids)
        while True:
            for delta in self.step():
                if delta.request_id == rid:
                    yield delta
                    if delta.finished:
                        return

    # ------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) with continuous batching; outputs in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidParameterError("prompts", "give either prompts or prompt_token_ids (exactly one)")
        texts: list[str | None]
        if prompt_token_ids is not None:
            token_lists: list[list[int] | None] = [list(t) for t in prompt_token_ids]
            texts = [None] * len(token_lists)
        else:
            texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
            token_lists = [None] * len(texts)
        params = _broadcast(sampling_params, len(texts))
        order: list[str] = []
        acc: dict[str, _Accumulator] = {}
        try:
            for text, toks, p in zip(texts, token_lists, params):
                rid = self.add_request(text, p, toks)
                order.append(rid)
                acc[rid] = _Accumulator(
                    text, self.engine.get_prompt_token_ids(rid), logprobs=[] if p.logprobs is not None else None
                )
        except Exception:
            for rid in order:  # all or nothing: a bad prompt must not leave the earlier ones running
                self.abort(rid)
            raise
        finals: dict[str, RequestDelta] = {}
        while len(finals) < len(order):
            for delta in self.step():
                a = acc.get(delta.request_id)
                if a is None:
                    continue
                a.token_ids.extend(delta.new_token_ids)
                a.text.append(delta.new_text)
                if a.logprobs is not None and delta.new_logprobs:
                    a.logprobs.extend(delta.new_logprobs)
                if delta.finished:
                    finals[delta.request_id] = delta
        return [self._output(rid, acc[rid], finals[rid]) for rid in order]

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat template."""
        if self.tokenizer is None:
            raise InvalidParameterError("messages", "this model has no tokenizer / chat template")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidParameterError("messages", "must be a non-empty list of {role, content} messages")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.chat_prompt(c) for c in conversations]  # type: ignore[arg-type]
        outs = self.generate(prompt_token_ids=[p.token_ids for p in prompts], sampling_params=sampling_params)
        return [_replace_prompt(o, p.text or "") for o, p in zip(outs, prompts)]

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, or has a delta not handed out by `step` yet."""
        return self.engine.has_unfinished()

    def queue_room(self) -> int | None:
        """How many more requests `add_request` accepts now (None = unbounded)."""
        return self.engine.queue_room()

    def engine_state(self) -> EngineState:
        """Requests running and waiting, KV-cache slots used and free, CPU threads (call between steps)."""
        cache = self.engine.cache
        threads = self.engine.threads.state
        return EngineState(self.engine.num_running, self.engine.num_waiting, cache.num_used_slots,
                           cache.num_free_slots, num_threads=threads.num_threads, free_cpus=threads.free_cpus)

    def get_metrics(self) -> dict[str, Any]:
        """Cumulative speculation metrics (JSON-ready), same definitions as every other sink.

        Each k policy of the engine that keeps estimates adds them as "<name>_policy": with the ngram proposer,
        "goodput_policy" holds what the goodput policy decides from (throughput, step cost by new tokens,
        acceptance by match length and position); they are kept whichever policy the engine runs, since any
        request may choose goodput. "sink_errors" counts exceptions raised by stats sinks (isolated from requests).
        """
        metrics = self.engine.recorder.snapshot().to_dict()
        metrics["sink_errors"] = self.engine.recorder.sink_errors
        for name, estimates in self.engine.speculator.snapshots().items():
            metrics[f"{name}_policy"] = estimates
        return metrics

    def _output(self, rid: str, acc: _Accumulator, final: RequestDelta) -> RequestOutput:
        timings = final.timings or RequestTimings(0.0, None, None, 0)
        extra: dict[str, Any] = {}
        if final.error:
            extra["error"] = final.error
        return RequestOutput(
            request_id=rid,
            prompt=acc.prompt,
            prompt_token_ids=acc.prompt_token_ids,
            outputs=[CompletionOutput(0, "".join(acc.text), acc.token_ids, final.finish_reason, acc.logprobs)],
            finished=True,
            spec_stats=final.spec_stats,
            timings=timings,
            extra={"num_prompt_tokens": final.num_prompt_tokens, **extra},
        )


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidParameterError("sampling_params", f"got {len(params)} for {n} prompts")
    return list(params)


def _replace_prompt(out: RequestOutput, prompt: str) -> RequestOutput:
    from dataclasses import replace

    return replace(out, prompt=prompt)
