"""bench/serve.py end to end against a live server over the tiny model: every point completes, the report has
every column, and the JSON, markdown and plot files are written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from specd.config import SpeculationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import serve as serve_bench


def test_serve_benchmark_against_a_live_server(make_llm, start_server, tmp_path):
    registry = CollectorRegistry()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
    llm = make_llm(registry, speculation=spec, max_num_seqs=4, max_waiting=64, max_model_len=512)
    with start_server(llm, registry) as server:
        out = tmp_path / "points"
        code = serve_bench.main([
            "--url", server.url, "--api-key", server.api_key, "--kinds", "chat", "--num-requests", "6",
            "--warmup", "1", "--rates", "50,inf", "--concurrency", "2", "--ignore-eos",
            "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png",
        ])
    assert code == 0
    points = json.loads(Path(f"{out}.json").read_text())
    assert [(p["mode"], p["load"]) for p in points] == [("rate", 50.0), ("rate", float("inf")), ("concurrency", 2)]
    for point in points:
        assert point["completed"] == 6 and point["failed"] == 0
        assert point["output_throughput"] > 0 and all(v is not None for v in point["ttft_ms"])
        assert point["tpot_ms"][0] <= point["tpot_ms"][2]  # p50 <= p99
    # The server's own counters saw the speculation the benchmark pooled from the responses.
    assert any(p["acceptance_rate"] is not None for p in points)
    table = Path(f"{out}.md").read_text()
    assert "TTFT p50/p90/p99" in table and "conc 2" in table and "inf req/s" in table
    assert Path(f"{out}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_benchmark_refuses_bad_arguments(capsys):
    for argv, field in ((["--rates", "0"], "--rates"), (["--settings", "nope"], "--settings"),
                        (["--kinds", "poems"], "--kinds"), (["--url", "http://10.0.0.1:8000"], "--url"),
                        (["--rates", "", "--concurrency", ""], "--rates and --concurrency"),
                        (["--settings", "off,adaptive,off"], "named twice")):
        try:
            serve_bench.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert field in capsys.readouterr().err


def test_serve_benchmark_offers_an_a_a_control():
    args = serve_bench.parse_args(["--settings", "off,off-again,adaptive"])
    assert args.settings == ["off", "off-again", "adaptive"]
    assert serve_bench.SPEC_ARGS["off-again"] == serve_bench.SPEC_ARGS["off"]
