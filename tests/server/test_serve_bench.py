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
            "--warmup", "1", "--rates", "50,inf", "--concurrency", "2", "--ignore-eos", "--rounds", "2",
            "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png",
        ])
    assert code == 0
    points = json.loads(Path(f"{out}.json").read_text())
    assert [(p["mode"], p["load"]) for p in points] == [("rate", 50.0), ("rate", float("inf")), ("concurrency", 2)]
    for point in points:
        assert point["completed"] == 6 and point["failed"] == 0
        assert len(point["round_output_throughput"]) == 2  # --rounds 2: 3 requests a round, pooled
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
                        (["--settings", "off,adaptive,off"], "named twice"), (["--rounds", "0"], "--rounds"),
                        (["--rounds", "65"], "--rounds"), (["--num-requests", "4", "--rounds", "5"], "--rounds")):
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


def test_rounds_split_the_workload_once_and_keep_its_mix():
    items = serve_bench.build_workload(12, 0, ["rewrite", "code", "docqa"])
    parts = serve_bench.rounds_of(items, 3)
    assert len(parts) == 3 and sorted(map(id, (i for p in parts for i in p))) == sorted(map(id, items))
    assert [len({i.kind for i in p}) for p in parts] == [1, 1, 1]
    # Item i goes to part i % 3 and the kinds cycle with period 3: each part is one kind here; with 4 parts each
    # part holds every kind.
    assert [len(p) for p in serve_bench.rounds_of(items, 4)] == [3, 3, 3, 3]
    assert all({i.kind for i in p} == {"rewrite", "code", "docqa"} for p in serve_bench.rounds_of(items, 4))
    assert serve_bench.rounds_of(items, 1) == [items]


def test_rounds_are_reported_per_round():
    assert serve_bench.parse_args(["--rounds", "8"]).rounds == 8

    def point(setting: str, pooled: float, rounds: tuple[float, ...]) -> serve_bench.PointStats:
        times = (10.0, 20.0, 30.0)
        return serve_bench.PointStats(setting, "concurrency", 4.0, 64, 0, 10.0, 2.0, pooled, times, times, times,
                                      times, None, None, rounds)

    table = serve_bench.markdown([point("off", 100.0, (100.0, 50.0, 200.0)),
                                  point("adaptive", 110.0, (90.0, 60.0, 240.0))])
    # Pooled 1.1x; per round 0.9x, 1.2x, 1.2x: median 1.2x, range 0.9-1.2.
    assert "| adaptive | conc 4 | 1.100x | 1.000x | 1.200x (0.900-1.200) |" in table
    single = serve_bench.markdown([point("off", 100.0, ()), point("adaptive", 110.0, ())])
    assert "per-round" not in single and "| adaptive | conc 4 | 1.100x | 1.000x |" in single
