"""Test-wide settings.

Tiny in-process models gain nothing from intra-op threads, and when several processes share the 2 cores,
OpenMP threads spinning against each other make tiny steps ~100x slower; so tests run single-threaded,
except those on the real default model (marked `integration`), which use torch's default.
"""

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import settings

from specd.testing import byte_tokenizer, tiny_hf_config_dict, tiny_specd_model

_DEFAULT_THREADS = torch.get_num_threads()

# In CI, property tests replay the same examples every run, so a landing never hinges on a lucky draw;
# locally they keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _threads_per_test_kind(request):
    torch.set_num_threads(_DEFAULT_THREADS if request.node.get_closest_marker("integration") else 1)
    yield


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny random Llama in float64, so near-ties cannot flip between differently batched runs."""
    return tiny_specd_model(tiny_hf_config_dict(), seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer(320)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _pooled_from_counters(c: dict[str, Any]) -> dict[str, Any]:
    """The pooled derived values of docs/metrics.md recomputed from plain counters (None for 0/0), written
    independently of specd.metrics so tests can check every sink against the definitions."""
    mean_accepted = _ratio(c["accepted_tokens"], c["drafts"])
    return {
        "acceptance_rate_pooled": _ratio(c["accepted_tokens"], c["draft_tokens"]),
        "accepted_tokens_per_draft_pooled": mean_accepted,
        "mean_accepted_length_pooled": mean_accepted,  # the deprecated alias
        "mean_acceptance_length_pooled": None if mean_accepted is None else 1.0 + mean_accepted,
        "emitted_per_draft_pooled": _ratio(c["emitted_tokens"], c["drafts"]),
        "mean_proposed_length_pooled": _ratio(c["draft_tokens"], c["drafts"]),
        "tokens_per_seq_step_pooled": _ratio(
            c["emitted_tokens"] + c["nonspec_tokens"], c["drafts"] + c["nonspec_seq_steps"]
        ),
        "tokens_per_target_forward_pooled": _ratio(c["emitted_tokens"] + c["nonspec_tokens"], c["steps"]),
        "per_position_acceptance_pooled": [_ratio(a, d) for a, d in zip(c["accepted_at"], c["drafted_at"])],
        "conditional_acceptance_pooled": [_ratio(a, r) for a, r in zip(c["accepted_at"], c["reached_at"])],
    }


@pytest.fixture(scope="session")
def pooled_from_counters() -> Callable[[dict[str, Any]], dict[str, Any]]:
    return _pooled_from_counters
