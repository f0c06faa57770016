"""bench/ goes on sys.path (tests and the scripts insert it), so a bench module named like an installed package
shadows that package for everything imported after it: bench/kernels.py once hid PyPI's `kernels`, which
transformers imports, and every test that built a transformers model failed on a fresh install."""

import sys
from importlib.machinery import PathFinder
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_module_shadows_an_importable_package():
    others = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    modules = sorted(path.stem for path in BENCH.glob("*.py"))
    assert "decode" in modules  # the glob found the scripts
    shadowing = [name for name in modules if name in sys.stdlib_module_names or PathFinder.find_spec(name, others)]
    assert not shadowing, f"bench modules named like importable packages: {shadowing}; rename them"
