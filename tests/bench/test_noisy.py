"""bench/noisy.py's tables: medians per condition and the hog / quiet ratio of the same setting."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from decode import RunTiming
from noisy import SERVERS, engine_table, server_table


def _timing(ttft_s: float, decode_rate: float) -> RunTiming:
    # 100 decode tokens over 100 / rate seconds after the first token
    return RunTiming(ttft_s, ttft_s, ttft_s + 100 / decode_rate, 101, 100, 0.5)


def test_engine_table_ratios_are_hog_over_quiet_medians():
    runs = {
        ("adaptive", "quiet"): [(_timing(0.5, 1.0), _timing(0.1, 100.0)), (_timing(0.6, 1.0), _timing(0.1, 120.0)),
                                (_timing(2.0, 1.0), _timing(0.1, 110.0))],
        ("adaptive", "hog"): [(_timing(1.2, 1.0), _timing(0.1, 55.0)), (_timing(0.9, 1.0), _timing(0.1, 50.0)),
                              (_timing(1.0, 1.0), _timing(0.1, 60.0))],
    }
    row = engine_table(runs, ["adaptive"]).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "adaptive"
    assert cells[1] == "600 (500-2000)" and cells[2] == "1000 (900-1200)"
    assert cells[3] == f"{1000 / 600:.2f}"  # TTFT: median hog / median quiet
    assert cells[6] == f"{55.0 / 110.0:.2f}"  # decode: median hog / median quiet


def test_server_table_has_a_row_per_server():
    figures = {"ttft_ms": 500.0, "decode_tok_s": 100.0, "loop2_tok_s": 150.0}
    slower = {"ttft_ms": 1000.0, "decode_tok_s": 50.0, "loop2_tok_s": 75.0}
    results = {(name, c): [figures if c == "quiet" else slower] for name in SERVERS for c in ("quiet", "hog")}
    rows = server_table(results).splitlines()[2:]
    assert len(rows) == len(SERVERS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "2.00" and cells[6] == "0.50" and cells[9] == "0.50"
