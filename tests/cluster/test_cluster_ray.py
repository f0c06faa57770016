"""Two specd replicas of the tiny model on a local Ray Serve, driven through the one endpoint with the official
OpenAI client: both replicas serve, greedy outputs equal one in-process LLM, the pooled speculation counters equal
the sum of the responses' usage, and a replica killed mid-stream costs that stream an error event, nothing else.

Ray starts with 2 CPUs, no dashboard and a small object store, once for the module, and is always shut down.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'specd[cluster]'; CI installs it)")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'specd[cluster]')")

from specd.cluster.deployment import DEPLOYMENT_NAME, build_application  # noqa: E402
from specd.cluster.frontend import REPLICA_HEADER  # noqa: E402
from specd.cluster.launch import APP_NAME  # noqa: E402
from specd.cluster.options import ClusterSettings  # noqa: E402
from specd.cluster.replica_spec import ReplicaSpec  # noqa: E402
from specd.cluster.stream_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV  # noqa: E402
from specd.config import EngineConfig, SpeculationConfig  # noqa: E402
from specd.sampling.params import SamplingParams  # noqa: E402
from specd.server.app import ServerSettings  # noqa: E402
from specd.testing import tiny_llm  # noqa: E402

API_KEY = "cluster-key"
MODEL = "tiny"
SPEC = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
CONFIG = EngineConfig(speculation=SPEC, max_model_len=256, max_num_seqs=2, max_waiting=64, num_threads=1)
STEP_DELAY_S = 0.02  # slow enough that a long stream is still running when its replica is killed
SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass
class Endpoint:
    url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s}s: {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    # Workers import specd from this checkout, and the proxies load the stream guard (both read at start).
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    port = _free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024**2, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(CONFIG, ServerSettings(MODEL, API_KEY), llm_factory=partial(tiny_llm,
                           step_delay_s=STEP_DELAY_S), metrics_push_interval_s=0.5)
        cluster = ClusterSettings(num_replicas=2, replica_cpus=1.0, max_ongoing_requests=2)
        serve.run(build_application(spec, cluster), name=APP_NAME, route_prefix="/")
        yield Endpoint(f"http://127.0.0.1:{port}")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


PROMPTS = ["abc abc abc abc abc abc", "one two one two one two one", "xyzxyzxyzxyz", "Zebra zebra Zebra",
           "the quick brown fox. the quick", "1 2 3 1 2 3 1 2", "hello hello hello", "aaaa bbbb aaaa bbbb"]


async def _completion(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, dict]:
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPTS[index], max_tokens=12 + 3 * index, temperature=0)
    body = raw.parse()
    return raw.headers[REPLICA_HEADER], body.choices[0].text, body.usage.model_extra["speculative_decoding"]


async def _streamed(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, dict]:
    async with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPTS[index], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        text, usage = [], None
        async for chunk in await raw.parse():
            text.extend(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                usage = chunk.usage.model_extra["speculative_decoding"]
        return raw.headers[REPLICA_HEADER], "".join(text), usage


async def _traffic(endpoint: Endpoint) -> list[tuple[str, str, dict]]:
    client = endpoint.client()
    calls = [_completion(client, i) for i in range(len(PROMPTS))] + [_streamed(client, i) for i in range(4)]
    return list(await asyncio.gather(*calls))


def _expected_texts() -> list[str]:
    llm = tiny_llm(CONFIG)
    completions = llm.generate(PROMPTS, [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0)
                                         for i in range(len(PROMPTS))])
    streamed = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=20, temperature=0.0))
    return [out.outputs[0].text for out in completions + streamed]


COUNTERS = ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens")


def test_replicas_serve_the_openai_api_and_pool_their_counters(endpoint):
    results = asyncio.run(_traffic(endpoint))
    replicas = {replica for replica, _, _ in results}
    assert len(replicas) == 2, replicas  # 12 concurrent requests, 2 per replica at once: both had to serve
    assert [text for _, text, _ in results] == _expected_texts()
    expected = {name: sum(usage[name] for _, _, usage in results) for name in COUNTERS}
    assert expected["drafts"] > 0

    # Each replica pushes its counters to the hub; the answering one pushes its own before reading.
    def pooled_counters() -> dict:
        return {name: endpoint.get("/v1/spec/stats").json()["metrics"]["counters"][name] for name in COUNTERS}

    _wait_for(lambda: pooled_counters() == expected, 30, "pooled counters equal the sum of the usages")
    stats = endpoint.get("/v1/spec/stats").json()
    rows = {row["replica"]: row for row in stats["replicas"]}
    assert set(rows) == replicas and all(row["live"] for row in rows.values())
    assert sum(row["finished_requests"] for row in rows.values()) == len(results)
    assert all(row["finished_requests"] > 0 for row in rows.values())
    assert stats["metrics"]["derived"]["acceptance_rate_pooled"] == pytest.approx(
        expected["accepted_tokens"] / expected["draft_tokens"])
    assert stats["engine"]["kv_free_slots"] == 2 * CONFIG.max_num_seqs  # summed over the two idle replicas

    # One scrape carries both replicas' series, labelled; summed they equal the pooled counters.
    samples = [s for family in text_string_to_metric_families(endpoint.get("/metrics").text) for s in family.samples]
    drafts = {s.labels["replica"]: s.value for s in samples if s.name == "specd_spec_decode_drafts_total"}
    assert set(drafts) == replicas
    assert sum(drafts.values()) == expected["drafts"]
    errors = endpoint.get("/v1/spec/stats").headers  # the replica header is on every answer
    assert errors[REPLICA_HEADER] in replicas
    unauthorized = httpx.get(f"{endpoint.url}/v1/spec/stats", timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"


def _replica_actor(replica: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"{DEPLOYMENT_NAME}#{replica}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no actor for replica {replica}")


async def _killed_mid_stream(endpoint: Endpoint) -> tuple[str, int, BaseException | None]:
    """Stream a long request, kill its replica after the first tokens; what did the client see?"""
    client = endpoint.client()
    received = 0
    async with client.completions.with_streaming_response.create(
        model=MODEL, prompt="a long one", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "speculation": {"enabled": False}},
    ) as raw:
        replica = raw.headers[REPLICA_HEADER]
        try:
            async for chunk in await raw.parse():
                received += sum(len(choice.text) > 0 for choice in chunk.choices)
                if received == 3:
                    ray.kill(_replica_actor(replica), no_restart=True)
        except openai.APIError as exc:
            return replica, received, exc
    return replica, received, None


def _running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    return status.replica_states.get("RUNNING", 0)


def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error(endpoint):
    replica, received, error = asyncio.run(_killed_mid_stream(endpoint))
    assert error is not None, f"the stream finished normally after {received} chunks"
    assert received < 200
    assert "replica" in str(error) and error.body["code"] == "replica_failed"

    # The next requests succeed (on the surviving replica until the dead one is replaced) ...
    async def next_requests() -> list[tuple[str, str, dict]]:
        client = endpoint.client()
        return [await _completion(client, index) for index in range(4)]

    for served_by, text, _ in asyncio.run(next_requests()):
        assert served_by != replica and text

    # ... and Ray Serve replaces the dead replica: two running, and a new one pushing its figures.
    _wait_for(lambda: _running_replicas() == 2, 90, "Ray Serve restarted the killed replica")

    def others_live() -> set[str]:
        rows = endpoint.get("/v1/spec/stats").json()["replicas"]
        return {row["replica"] for row in rows if row["live"]} - {replica}

    _wait_for(lambda: len(others_live()) == 2, 60, "the replacement replica reports to the metrics hub")
