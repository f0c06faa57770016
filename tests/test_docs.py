"""The docs name only what exists: every `--flag` in README.md and docs/*.md is accepted by the command the text
runs (a `specd` subcommand, a bench/ script) or, where the text runs none, by some specd or bench command (or is
another tool's flag, listed below on purpose), and every Prometheus name docs/metrics.md, docs/server.md and the
Grafana dashboard use is exported at /metrics.

Flags are read from code only: fenced blocks and `inline code`. A piece of code (a code-block line, with its
backslash continuations, cut at `&&`, `;` and `|`; or an inline span) that runs `specd <subcommand>` or
`bench/<script>.py` is checked against that command's own flags; other code, and code-block comments, against all
of them together. The specd flags come from the parser `specd` itself builds (specd.cli.build_parser, `specd
stats` included); a bench script's from its `add_argument("--...")` calls, read as text so that no script is
imported."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specd.cli import build_parser
from specd.config import EngineConfig, SpeculationConfig
from specd.llm import LLM
from specd.metrics.prometheus_sink import PrometheusSink
from specd.metrics.trace_cli import _parser as stats_parser
from specd.server.app import build_app
from specd.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
METRIC_DOCS = (ROOT / "docs" / "metrics.md", ROOT / "docs" / "server.md")
DASHBOARDS = tuple(sorted((ROOT / "docs" / "grafana").glob("*.json")))

# Flags of other tools that the docs name on purpose, with why.
EXTERNAL_FLAGS = {
    # pip, installing bench/decode.py's llama.cpp peer (llama-cpp-python) from source (docs/benchmarks.md)
    "--force-reinstall": "pip",
    "--no-cache-dir": "pip",
    "--no-deps": "pip",
    # docker: a container's CPU quota, the cgroup limit --thread-policy adaptive reads (docs/server.md)
    "--cpus": "docker",
}

_FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# bench/serve.py --server-arg=--dtype=int4: the inner flag is one of `specd serve`'s
_SERVER_ARG = re.compile(r"--server-arg[= ]['\"]?(--[a-z][a-z0-9-]+)")
_SPECD = re.compile(r"(?:^|[\s/])specd\s+(generate|serve|train-draft|stats)\b")
_BENCH = re.compile(r"(?<![\w/.-])bench/([a-z_0-9]+)\.py\b")
_ADD_ARGUMENT = re.compile(r"add_argument\(\s*((?:[\"'][^\"']*[\"']\s*,\s*)+)")
# a metric name; not a JSON key such as a trace header's "specd_version"
_METRIC = re.compile(r"(?<![\w:\"])(?:specd_|vllm:)[A-Za-z0-9_:]*\*?")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for option in parser._option_string_actions if option.startswith("--")}


@cache
def specd_flags() -> dict[str, frozenset[str]]:
    """{subcommand: its long flags, the top-level parser's included}."""
    parser = build_parser()
    top = _option_strings(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: frozenset(top | _option_strings(p)) for name, p in sub.choices.items()}
    flags["stats"] = frozenset(top | _option_strings(stats_parser()))
    return flags


@cache
def bench_flags() -> dict[str, frozenset[str]]:
    """{bench script's stem: the long flags its argparse calls declare}."""
    flags: dict[str, frozenset[str]] = {}
    for script in sorted((ROOT / "bench").glob("*.py")):
        found: set[str] = set()
        for call in _ADD_ARGUMENT.finditer(script.read_text()):
            found.update(_FLAG.findall(call.group(1)))
        flags[script.stem] = frozenset(found)
    return flags


def all_flags() -> frozenset[str]:
    return frozenset().union(*specd_flags().values(), *bench_flags().values(), EXTERNAL_FLAGS)


def code_of(text: str) -> Iterator[tuple[str, bool]]:
    """(piece, is_command): each command and each comment of the fenced blocks (a comment is prose, not a
    command), then each inline code span elsewhere."""
    for block in _FENCE.finditer(text):
        for line in block.group(1).replace("\\\n", " ").splitlines():
            line, _, comment = line.partition(" #")
            for command in re.split(r"&&|;|\|", line):
                yield command, True
            yield comment, False
    for span in _INLINE.findall(_FENCE.sub("", text)):
        yield span, True


def unknown_flags(piece: str, is_command: bool) -> list[str]:
    """The flags in `piece` that nothing it may be about accepts: the command it runs, when `is_command` and it
    runs one of specd's or bench's, else any of them."""
    serve = specd_flags()["serve"]
    bad = [flag for flag in _SERVER_ARG.findall(piece) if flag not in serve]
    piece = _SERVER_ARG.sub("--server-arg=", piece)
    accepted = all_flags()
    if is_command:
        bench = _BENCH.search(piece)
        specd = _SPECD.search(piece)
        if bench is not None and bench.group(1) in bench_flags():
            accepted = bench_flags()[bench.group(1)] | EXTERNAL_FLAGS.keys()
        elif specd is not None:
            accepted = specd_flags()[specd.group(1)] | EXTERNAL_FLAGS.keys()
    return bad + [flag for flag in _FLAG.findall(piece) if flag not in accepted]


def test_flag_sources_are_found() -> None:
    """The parsers are the real ones: a test that read no flags would pass on any doc."""
    assert {"--spec", "--num-spec-tokens", "--max-tokens"} <= specd_flags()["generate"]
    assert {"--port", "--api-key", "--spec"} <= specd_flags()["serve"]
    assert {"--init-from", "--data-cache"} <= specd_flags()["train-draft"]
    assert {"--settings", "--server-arg", "--rates"} <= bench_flags()["serve"]
    assert "--heads" in bench_flags()["head_eval"]


@pytest.mark.parametrize(
    ("piece", "is_command", "expected"),
    [
        ("specd generate hi --spec ngram --no-such-flag", True, ["--no-such-flag"]),
        (".venv/bin/specd serve --port 8000 --data-cache x", True, ["--data-cache"]),  # train-draft's, not serve's
        (".venv/bin/python bench/serve.py --settings off --server-arg=--dtype=int4", True, []),
        (".venv/bin/python bench/serve.py --server-arg=--no-such-flag=1 --specs off", True,
         ["--no-such-flag", "--specs"]),
        ("--spec eagle", False, []),
        ("--specs", False, ["--specs"]),
    ],
)
def test_unknown_flags_are_caught(piece: str, is_command: bool, expected: list[str]) -> None:
    assert unknown_flags(piece, is_command) == expected


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_flags_that_exist(doc: Path) -> None:
    stale = sorted({
        f"{flag} (in `{piece.strip()[:80]}`)"
        for piece, is_command in code_of(doc.read_text())
        for flag in unknown_flags(piece, is_command)
    })
    assert not stale, f"{doc.relative_to(ROOT)} names flags nothing accepts:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_run_only_bench_scripts_that_exist(doc: Path) -> None:
    """A command of a script that is gone would otherwise be checked against every flag instead of its own."""
    named = set(_BENCH.findall(doc.read_text()))
    assert not named - bench_flags().keys(), f"{doc.relative_to(ROOT)} names bench scripts that do not exist"


def _strings(value: object) -> Iterator[str]:
    """Every string in a JSON document (a dashboard's queries, variables and descriptions)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _documented_metrics() -> dict[str, set[str]]:
    """{metric name (a trailing * is a prefix): where it is named}."""
    named: dict[str, set[str]] = {}
    for doc in METRIC_DOCS:
        text = doc.read_text()
        code = [block.group(1) for block in _FENCE.finditer(text)] + _INLINE.findall(_FENCE.sub("", text))
        for piece in code:
            for name in _METRIC.findall(piece):
                named.setdefault(name, set()).add(doc.name)
    for dashboard in DASHBOARDS:
        for string in _strings(json.loads(dashboard.read_text())):
            for name in _METRIC.findall(string):
                named.setdefault(name, set()).add(f"grafana/{dashboard.name}")
    return named


_SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@pytest.fixture(scope="module")
def exported_names(tiny_model: Any, tokenizer: Any) -> set[str]:
    """Every family name /metrics exposes, and its sample names (x_total, x_bucket, ...), for a server built the
    way `specd serve --vllm-compat-metrics` builds it with speculation on (so every family exists)."""
    registry = CollectorRegistry()
    spec = SpeculationConfig(method="ngram", num_speculative_tokens=4, k_policy="heuristic")
    sink = PrometheusSink(registry, "tiny", spec.method, spec.k_policy, vllm_compat=True, speculating=True)
    llm = LLM.from_model(tiny_model, tokenizer, EngineConfig(speculation=spec, max_model_len=256), stats_sinks=[sink])
    try:
        app = build_app(llm, ServerSettings("tiny", vllm_compat_metrics=True), registry)
        response = TestClient(app, base_url="http://127.0.0.1").get("/metrics")  # no lifespan: no engine thread
        assert response.status_code == 200
        names: set[str] = set()
        for family in text_string_to_metric_families(response.text):
            names.add(family.name)
            names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
        return names
    finally:
        llm.close()


def test_documented_metrics_are_exported(exported_names: set[str]) -> None:
    named = _documented_metrics()
    assert "specd_spec_decode_drafts_total" in named and "vllm:spec_decode_num_drafts_total" in named
    missing = sorted(
        f"{name} ({', '.join(sorted(where))})"
        for name, where in named.items()
        if not (any(e.startswith(name[:-1]) for e in exported_names) if name.endswith("*") else name in exported_names)
    )
    assert not missing, "documented but not exported at /metrics:\n" + "\n".join(missing)
