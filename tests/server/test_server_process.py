"""`specd serve` as a process: SIGTERM during a stream ends it with a final error event, logs no traceback,
and the process exits 0 (uvicorn alone would re-raise the signal and die with -15)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

SERVER_SCRIPT = """
import sys, time, torch
from prometheus_client import CollectorRegistry
from specd.config import EngineConfig
from specd.llm import LLM
from specd.testing import byte_tokenizer
from specd.server.app import ServerSettings, build_app, serve

torch.set_num_threads(1)
llm = LLM.from_model(torch.load(sys.argv[1], weights_only=False), byte_tokenizer(320),
                     EngineConfig(max_model_len=256, max_num_seqs=2))
step = llm.step

def slow_step():
    time.sleep(0.02)  # a 200-token request is still running when the signal comes
    return step()

llm.step = slow_step
settings = ServerSettings("tiny", shutdown_grace_s=0.5)
sys.exit(serve(build_app(llm, settings, CollectorRegistry()), settings, host="127.0.0.1", port=0))
"""


def test_sigterm_ends_streams_and_exits_zero(tiny_model, tmp_path: Path):
    model_path = tmp_path / "tiny.pt"
    torch.save(tiny_model, model_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), *sys.path])}
    process = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(model_path)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    ready = threading.Event()

    def collect() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if "Uvicorn running on" in line:
                ready.set()

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    try:
        assert ready.wait(120), "".join(output)
        port = re.search(r"http://127\.0\.0\.1:(\d+)", "".join(output)).group(1)
        events: list[str] = []
        body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 3:
                    process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(60) == 0, "".join(output)
        assert time.monotonic() - started < 30
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    collector.join(10)
    log = "".join(output)
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log and "ERROR" not in log, log
