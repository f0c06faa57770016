"""Test-wide settings.

Tiny in-process models gain nothing from intra-op threads, and when several processes share the 2 cores,
OpenMP threads spinning against each other make tiny steps ~100x slower; so tests run single-threaded,
except those on the real default model (marked `integration`), which use torch's default.
"""

import os

import pytest
import torch
from hypothesis import settings

from specd.model.tokenizer import Tokenizer
from specd.testing import tiny_hf_config_dict, tiny_specd_model

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
    return Tokenizer.for_tests(320)
