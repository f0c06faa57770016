"""Request-level Prometheus metrics of the server (the speculation families come from PrometheusSink).

Engine figures are written from the engine thread (gauges after each step, histograms and counters
when a request finishes), so they are measured on the engine's clock: TTFT runs from `add_request` to
the first emitted token and excludes HTTP parsing and tokenization. Only the error counter is
written from the HTTP side (prometheus_client metrics are thread-safe).

With vllm_compat the figures that have a vLLM v1 counterpart are written under vLLM's names too (labels
`model_name` and `engine`, as vLLM's), with the same values: the same observation goes to both.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.engine.outputs import RequestDelta

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _VllmRequestMetrics:
    """vLLM v1's names for the request figures specd measures (docs/metrics.md "vLLM compatibility")."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str) -> None:
        labels = ("model_name", "engine")
        values = (model_name, engine)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=registry).labels(*values)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=registry).labels(*values)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=registry).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=registry).labels(*values)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*labels, "finished_reason"), registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_LATENCY_BUCKETS, registry=registry).labels(*values)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              labels, buckets=_TPOT_BUCKETS, registry=registry).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=_LATENCY_BUCKETS, registry=registry).labels(*values)
        self.values = values


class RequestMetrics:
    """specd_* request metrics in a caller-owned registry, labelled by served model name (and vLLM's names of
    the same figures with vllm_compat)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, vllm_compat: bool = False,
                 vllm_engine: str = "0") -> None:
        labels = ("model",)
        self._running = Gauge(
            "specd_num_requests_running", "Requests holding a KV slot (prefilling or decoding).",
            labels, registry=registry,
        ).labels(model_name)
        self._waiting = Gauge(
            "specd_num_requests_waiting", "Requests queued for a KV slot.", labels, registry=registry
        ).labels(model_name)
        self._in_line = Gauge(
            "specd_num_requests_in_line",
            "Requests waiting in the admission line for room in the waiting queue (--queue-timeout).",
            labels, registry=registry,
        ).labels(model_name)
        self._kv_used = Gauge(
            "specd_kv_cache_used_slots", "KV-cache slots in use (one per running sequence).",
            labels, registry=registry,
        ).labels(model_name)
        self._threads = Gauge(
            "specd_cpu_threads", "CPU threads the engine's forwards run (--thread-policy adaptive: the free cores).",
            labels, registry=registry,
        ).labels(model_name)
        self._free_cpus = Gauge(
            "specd_cpu_free_cores",
            "Cores of the process's CPUs that other processes left free over the last half second (NaN: not "
            "measured, --thread-policy fixed).", labels, registry=registry,
        ).labels(model_name)
        self._ttft = Histogram(
            "specd_time_to_first_token_seconds", "Arrival in the engine to first emitted token.",
            labels, buckets=_LATENCY_BUCKETS, registry=registry,
        ).labels(model_name)
        self._tpot = Histogram(
            "specd_time_per_output_token_seconds",
            "(finish - first token) / (output tokens - 1), per request with at least two tokens.",
            labels, buckets=_TPOT_BUCKETS, registry=registry,
        ).labels(model_name)
        self._e2e = Histogram(
            "specd_e2e_request_latency_seconds", "Arrival in the engine to finish.",
            labels, buckets=_LATENCY_BUCKETS, registry=registry,
        ).labels(model_name)
        self._prompt_tokens = Counter(
            "specd_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=registry
        ).labels(model_name)
        self._generation_tokens = Counter(
            "specd_generation_tokens", "Generated tokens of finished requests (aborted ones included).",
            labels, registry=registry,
        ).labels(model_name)
        self._finished = Counter(
            "specd_request_finished",
            "Engine requests finished, by finish_reason (stop, length, abort, error). One per choice.",
            ("model", "finish_reason"), registry=registry,
        )
        # Per HTTP request (a request with n choices and P prompts is one here, P * n engine requests above).
        self._http_requests = Counter(
            "specd_http_requests",
            "HTTP generation requests whose choices were all admitted to the engine (one per request, any n).",
            labels, registry=registry,
        ).labels(model_name)
        self._http_choices = Counter(
            "specd_http_request_choices",
            "Choices (engine requests, prompts x n) of the admitted HTTP requests; / specd_http_requests_total "
            "is the mean number of choices per HTTP request.",
            labels, registry=registry,
        ).labels(model_name)
        self._errors = Counter(
            "specd_request_errors",
            "HTTP requests answered with an error status, by error code "
            "(queue_full, invalid_value, invalid_api_key, http_404, internal_error, ...).",
            ("model", "code"), registry=registry,
        )
        self._model_name = model_name
        self._vllm = _VllmRequestMetrics(registry, model_name, vllm_engine) if vllm_compat else None

    def set_engine_state(self, num_running: int, num_waiting: int, kv_used_slots: int, num_in_line: int = 0,
                         num_threads: int = 1, free_cpus: float | None = None) -> None:
        self._threads.set(num_threads)
        self._free_cpus.set(math.nan if free_cpus is None else free_cpus)
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_used.set(kv_used_slots)
        self._in_line.set(num_in_line)
        if self._vllm is not None:
            self._vllm.running.set(num_running)
            self._vllm.waiting.set(num_waiting)

    def observe_admitted(self, num_choices: int) -> None:
        """Record one HTTP request whose num_choices engine requests were all added to the engine."""
        self._http_requests.inc()
        self._http_choices.inc(num_choices)

    def observe_finished(self, delta: RequestDelta) -> None:
        """Record one finished engine request from its final delta."""
        vllm = self._vllm
        reason = delta.finish_reason or "unknown"
        self._finished.labels(self._model_name, reason).inc()
        self._prompt_tokens.inc(delta.num_prompt_tokens)
        self._generation_tokens.inc(delta.num_output_tokens)
        if vllm is not None:
            vllm.success.labels(*vllm.values, reason).inc()
            vllm.prompt_tokens.inc(delta.num_prompt_tokens)
            vllm.generation_tokens.inc(delta.num_output_tokens)
        timings = delta.timings
        if timings is None:
            return
        if timings.ttft_s is not None:
            self._ttft.observe(timings.ttft_s)
            if vllm is not None:
                vllm.ttft.observe(timings.ttft_s)
        if timings.e2e_s is not None:
            self._e2e.observe(timings.e2e_s)
            if vllm is not None:
                vllm.e2e.observe(timings.e2e_s)
        if timings.first_token_time is not None and timings.finish_time is not None and delta.num_output_tokens > 1:
            tpot_s = (timings.finish_time - timings.first_token_time) / (delta.num_output_tokens - 1)
            self._tpot.observe(tpot_s)
            if vllm is not None:
                vllm.tpot.observe(tpot_s)

    def observe_error(self, code: str) -> None:
        self._errors.labels(self._model_name, code).inc()
