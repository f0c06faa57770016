"""The engine's CPU thread count: the cgroup quota and affinity it starts from, the free cores it measures, and
the governor that follows them (specd/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specd.config import EngineConfig
from specd.errors import InvalidParameterError
from specd.llm import LLM
from specd.sampling.params import SamplingParams
from specd.threads import (
    CpuSample,
    ThreadGovernor,
    affinity_cpus,
    available_cpus,
    cgroup_cpu_quota,
    free_cpus,
    max_threads,
    read_cpu_sample,
)


def _cgroup_v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, limit in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(limit + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/outer/inner\n")
    return root, proc


def test_cgroup_v2_quota_is_the_tightest_on_the_way_up(tmp_path: Path) -> None:
    root, proc = _cgroup_v2(tmp_path, {"outer/inner": "max 100000", "outer": "150000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    root, proc = _cgroup_v2(tmp_path / "b", {"outer/inner": "50000 100000", "outer": "300000 100000"})
    assert cgroup_cpu_quota(root, proc) == 0.5
    root, proc = _cgroup_v2(tmp_path / "c", {"outer/inner": "max 100000", "outer": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None


def test_cgroup_v1_quota_and_missing_files(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    group = root / "cpu,cpuacct" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("200000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(root, proc) == 2.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(root, tmp_path / "no_such_file") is None


def test_available_cpus_and_max_threads_respect_affinity_and_callers_setting() -> None:
    cpus = available_cpus()
    assert 1 <= cpus <= len(affinity_cpus())
    assert max_threads(3) == 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert max_threads(None) == 1  # a caller's torch.set_num_threads is kept
        torch.set_num_threads(cpus + 7)
        assert max_threads(None) == cpus  # never more than the CPUs the process may use
    finally:
        torch.set_num_threads(before)


def test_free_cpus_counts_other_processes_and_steal() -> None:
    before = CpuSample(wall_s=10.0, busy_s=100.0, own_s=5.0)
    # 1 s of wall on 2 CPUs: 1.6 s busy in all, 1.0 s of it this process -> others kept 0.6 cores
    assert free_cpus(before, CpuSample(11.0, 101.6, 6.0), 2) == pytest.approx(1.4)
    assert free_cpus(before, CpuSample(11.0, 102.0, 5.0), 2) == 0.0  # both cores taken by others
    assert free_cpus(before, CpuSample(11.0, 100.0, 5.5), 2) == 2.0  # clamped: tick rounding below zero
    assert free_cpus(before, before, 2) == 2.0  # no wall time: nothing measured


def test_read_cpu_sample_sums_only_the_given_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    ticks = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        f"cpu  {9 * ticks} 0 0 0 0 0 0 0 0 0\n"
        f"cpu0 {ticks} 0 {ticks} 500 7 0 0 {ticks} {ticks} 0\n"
        f"cpu1 {4 * ticks} 0 0 500 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    sample = read_cpu_sample(frozenset({0}), stat)
    assert sample is not None and sample.busy_s == pytest.approx(3.0)  # user + system + steal; guest is in user
    both = read_cpu_sample(frozenset({0, 1}), stat)
    assert both is not None and both.busy_s == pytest.approx(7.0)
    assert read_cpu_sample(frozenset({0}), tmp_path / "missing") is None
    real = read_cpu_sample()
    if real is not None:  # Linux: cumulative counters that do not go backwards
        later = read_cpu_sample()
        assert later is not None and later.busy_s >= real.busy_s and later.own_s >= real.own_s


class _Fake:
    """A clock and /proc/stat under the test's control: `others` cores busy elsewhere, 2 CPUs."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.others = 0.0, 0.0, 0.0, 0.0
        self.applied: list[int] = []

    def advance(self, seconds: float, own_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + self.others) * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.busy, self.own)

    def governor(self, policy: str = "adaptive", most: int = 2) -> ThreadGovernor:
        return ThreadGovernor(most, policy, interval_s=0.5, sampler=self.sample, apply=self.applied.append,
                              num_cpus=2, clock=lambda: self.now)


def test_governor_follows_the_free_cores_with_hysteresis() -> None:
    fake = _Fake()
    gov = fake.governor()
    assert gov.adjust() == 2 and fake.applied == [2]  # set on the first forward, before anything is measured
    fake.advance(0.2, 2.0)
    assert gov.adjust() == 2 and fake.applied == [2]  # inside the window: nothing read
    fake.others = 0.7  # a neighbour, squeezed to 0.7 cores by our two threads, for the last 0.4 s of the window
    fake.advance(0.4, 1.3)
    assert gov.adjust() == 2  # 1.53 cores free over the window: still 2
    assert gov.state.free_cpus == pytest.approx(2 - 0.7 * 0.4 / 0.6)
    fake.advance(0.5, 1.3)
    assert gov.adjust() == 1 and fake.applied == [2, 1]  # a whole window at 1.3 free: down at once
    fake.others = 1.0
    for _ in range(3):
        fake.advance(0.5, 1.0)
        assert gov.adjust() == 1
    fake.others = 0.4  # 1.6 free: enough to keep a second thread, not to start one (no flapping at the edge)
    fake.advance(0.5, 1.0)
    assert gov.adjust() == 1
    fake.others = 0.0  # the neighbour stops: up after one window
    fake.advance(0.5, 1.0)
    assert gov.adjust() == 2 and fake.applied == [2, 1, 2]
    fake.others = 0.4
    fake.advance(0.5, 1.6)
    assert gov.adjust() == 2  # 1.6 free keeps the second thread
    assert gov.state.num_threads == 2 and gov.state.max_threads == 2


def test_a_window_the_engine_sat_idle_in_is_dropped() -> None:
    # Idle for 10 s while others were busy for most of it (a neighbour that has since stopped): that window
    # measured the past, so the count stays and a new window starts when stepping resumes.
    fake = _Fake()
    gov = fake.governor()
    gov.adjust()
    fake.advance(0.05, 2.0)
    gov.finished()
    fake.others = 1.5
    fake.advance(9.0, 0.0)
    fake.others = 0.0
    fake.advance(1.0, 0.0)
    assert gov.adjust() == 2 and gov.state.free_cpus is None
    fake.advance(0.5, 2.0)
    gov.finished()
    assert gov.adjust() == 2 and gov.state.free_cpus == pytest.approx(2.0)
    fake.others = 1.0  # a long busy step is not idle: its window counts
    fake.advance(3.0, 1.0)
    gov.finished()
    assert gov.adjust() == 1


def test_a_neighbour_that_ran_only_while_the_engine_waited_is_not_counted() -> None:
    # Two engines taking turns (a benchmark's interleaved rounds, two replicas served in turn): the other one
    # runs both cores for 0.7 s between our requests and stops as ours starts. A window spanning that gap would
    # count 2 cores busy and drop to one thread for the whole next request (a 1,000-token prompt: 1.5x slower).
    fake = _Fake()
    gov = fake.governor()
    gov.adjust()
    for _ in range(3):
        fake.advance(0.3, 2.0)
        gov.finished()
        fake.others = 2.0
        fake.advance(0.7, 0.0)  # we wait, the other engine runs
        fake.others = 0.0
        assert gov.adjust() == 2  # resumed: the window starts here
    fake.advance(0.6, 2.0)
    gov.finished()
    assert gov.adjust() == 2 and gov.state.free_cpus == pytest.approx(2.0)
    fake.others = 1.0  # while we step, it counts
    fake.advance(0.01, 1.0)
    gov.finished()
    fake.advance(0.6, 1.0)
    gov.finished()
    assert gov.adjust() == 1


def test_governor_never_goes_below_one_or_above_its_most() -> None:
    fake = _Fake()
    gov = fake.governor(most=1)
    gov.adjust()
    fake.others = 2.0
    for _ in range(4):
        fake.advance(0.5, 0.0)
        assert gov.adjust() == 1
    fake.others = 0.0
    for _ in range(4):
        fake.advance(0.5, 1.0)
        assert gov.adjust() == 1
    assert fake.applied == [1]


def test_fixed_policy_sets_once_and_never_measures() -> None:
    fake = _Fake()
    calls = []
    gov = ThreadGovernor(2, "fixed", sampler=lambda: calls.append(1) or fake.sample(), apply=fake.applied.append,
                         num_cpus=2, clock=lambda: fake.now)
    for _ in range(5):
        fake.others = 2.0
        fake.advance(1.0, 0.0)
        assert gov.adjust() == 2
    assert fake.applied == [2] and calls == [] and gov.state.free_cpus is None
    with pytest.raises(ValueError, match="thread policy"):
        ThreadGovernor(2, "spin")  # type: ignore[arg-type]


def test_config_validates_thread_policy() -> None:
    with pytest.raises(InvalidParameterError, match="thread_policy"):
        EngineConfig(thread_policy="busy")  # type: ignore[arg-type]
    assert EngineConfig().thread_policy == "adaptive"


def test_engine_sets_its_threads_on_the_thread_that_steps_it(tiny_model, tokenizer) -> None:
    # OpenMP's thread count is per calling thread: the engine must set it where its forwards run.
    import threading

    llm = LLM.from_model(tiny_model, tokenizer, EngineConfig(max_model_len=64, max_num_seqs=1, num_threads=1,
                                                             thread_policy="fixed"))
    seen: list[int] = []

    def run() -> None:
        torch.set_num_threads(2)  # what a fresh thread might start with
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [1]
    state = llm.engine_state()
    assert state.num_threads == 1 and state.free_cpus is None


@pytest.mark.skipif(len(affinity_cpus()) < 2 or read_cpu_sample() is None,
                    reason="needs Linux /proc/stat and 2 CPUs")
def test_free_cpus_sees_real_busy_processes() -> None:
    # As many spinning processes as CPUs leave (about) none of them free; timing-free: a loose bound only.
    cpus = affinity_cpus()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(cpus))]
    try:
        time.sleep(0.3)
        before = read_cpu_sample(cpus)
        time.sleep(0.6)
        after = read_cpu_sample(cpus)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert before is not None and after is not None
    assert free_cpus(before, after, len(cpus)) < len(cpus) - 0.5
