"""How many CPU threads the engine's forwards use: the cores this process may run on, less those other
processes keep busy.

torch's intra-op pool and specd's kernels run on OpenMP, whose threads spin-wait at the end of every parallel
region. When another process holds one of the cores, the thread that shares it with that process is
descheduled for whole scheduler slices, and every parallel region (hundreds per token) waits for it: a
2-thread decode on 2 cores with one busy core runs 3-4x slower than the same decode on one thread, which the
busy core does not touch. So the thread count follows what is free:

- the most threads: `--threads`, or else torch's setting when the engine is built (OpenMP's default: the
  CPUs of the affinity mask, or OMP_NUM_THREADS) capped by the cgroup CPU quota (a container's `--cpus`),
  which OpenMP's own default ignores;
- every `interval_s` (0.5 s) of stepping, the engine thread reads /proc/stat and its own CPU time and counts
  how many cores of its affinity mask other processes (and the hypervisor, as steal time) kept busy; the
  threads are the cores left, at least one, with a quarter core of hysteresis so a count near a boundary does
  not flap. Windows hold only the engine's stepping: when it resumes after sitting idle (over RESUME_GAP_S
  since its last forward ended), a new window starts there, since what other processes did while it waited (a
  neighbour that ran in between, then stopped) is not what its threads will meet now.

The count is set on the engine thread itself (torch.set_num_threads writes the calling thread's OpenMP
setting), before its first forward and whenever it changes. A fixed policy (`--thread-policy fixed`) sets the
most threads once and never measures.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, get_args

import torch

from specd.config import ThreadPolicy

THREAD_POLICIES = get_args(ThreadPolicy)
INTERVAL_S = 0.5
RESUME_GAP_S = 0.1  # a pause between forwards this long is idleness: the window restarts when stepping resumes
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user already)


def affinity_cpus() -> frozenset[int]:
    """The CPUs this process may run on (all online ones where the platform has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """The process's cgroup CPU quota in cores (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / period), or None
    where there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        rel = path.lstrip("/")
        if controllers == "":
            quota = _v2_quota(root, rel)
        elif "cpu" in controllers.split(","):
            quota = _v1_quota(root / controllers, rel) or _v1_quota(root / "cpu", rel)
        else:
            continue
        if quota is not None:
            return quota
    return None


def _v2_quota(root: Path, rel: str) -> float | None:
    # The tightest limit on the way up from the process's own group counts.
    best: float | None = None
    group = root / rel
    while True:
        try:
            limit, period = (group / "cpu.max").read_text().split()[:2]
            if limit != "max":
                cores = int(limit) / int(period)
                best = cores if best is None else min(best, cores)
        except (OSError, ValueError):
            pass
        if group == root or root not in group.parents:
            return best
        group = group.parent


def _v1_quota(root: Path, rel: str) -> float | None:
    for group in (root / rel, root):
        try:
            quota = int((group / "cpu.cfs_quota_us").read_text())
            period = int((group / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return quota / period
    return None


def available_cpus() -> int:
    """The most threads worth running: the affinity mask's CPUs, capped by the cgroup quota (rounded up, so
    1.5 cores of quota run 2 threads), at least 1."""
    cpus = len(affinity_cpus())
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def max_threads(num_threads: int | None) -> int:
    """The most threads an engine runs: `num_threads` when given, else torch's current setting on the calling
    thread (OpenMP's default: the affinity mask, or OMP_NUM_THREADS; or what the caller set) capped by
    available_cpus(), so a container's quota counts and a caller's torch.set_num_threads is kept."""
    if num_threads is not None:
        return max(1, num_threads)
    return max(1, min(torch.get_num_threads(), available_cpus()))


class CpuSample(NamedTuple):
    """Cumulative CPU counters at one moment, in seconds."""

    wall_s: float
    busy_s: float  # busy time of the affinity mask's CPUs, every process's (steal included)
    own_s: float  # this process's CPU time (all its threads)


def read_cpu_sample(cpus: frozenset[int] | None = None, stat: Path = Path("/proc/stat")) -> CpuSample | None:
    """Busy time of `cpus` (default: the affinity mask) from /proc/stat, and this process's CPU time; None
    where /proc/stat cannot be read (not Linux)."""
    cpus = affinity_cpus() if cpus is None else cpus
    try:
        text = stat.read_text()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            index = int(name[3:])
        except ValueError:
            continue
        if index in cpus:
            values = rest.split()
            busy += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return CpuSample(time.monotonic(), busy / ticks, time.process_time())


def free_cpus(before: CpuSample, after: CpuSample, num_cpus: int) -> float:
    """Cores of `num_cpus` that other processes left free between two samples (0..num_cpus)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return float(num_cpus)
    others = (after.busy_s - before.busy_s - (after.own_s - before.own_s)) / wall
    return min(float(num_cpus), max(0.0, num_cpus - others))


@dataclass(frozen=True, slots=True)
class ThreadState:
    """What the governor runs now and what it last measured."""

    num_threads: int
    max_threads: int
    free_cpus: float | None  # None: not measured (fixed policy, no /proc/stat, or no window yet)


class ThreadGovernor:
    """Sets the calling (engine) thread's torch thread count: `max_threads` under the fixed policy, the free
    cores (1..max_threads) under the adaptive one. The engine calls `adjust()` before each forward and
    `finished()` after it; both are cheap between measurements (one clock read)."""

    def __init__(self, max_threads: int, policy: ThreadPolicy = "adaptive", interval_s: float = INTERVAL_S,
                 sampler: Callable[[], CpuSample | None] = read_cpu_sample,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 num_cpus: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in THREAD_POLICIES:
            raise ValueError(f"thread policy must be one of {', '.join(THREAD_POLICIES)}, got {policy!r}")
        self.max_threads = max(1, max_threads)
        self.adaptive = policy == "adaptive"
        self.interval_s = interval_s
        self._sampler = sampler
        self._apply = apply
        self._clock = clock  # the clock the sampler's wall_s reads
        self._num_cpus = len(affinity_cpus()) if num_cpus is None else num_cpus
        self._threads = 0  # 0: not applied yet on the engine thread
        self._last: CpuSample | None = None
        self._free: float | None = None
        self._ended: float | None = None  # when the last forward ended

    @property
    def state(self) -> ThreadState:
        return ThreadState(self._threads or self.max_threads, self.max_threads, self._free)

    def adjust(self) -> int:
        """Call on the engine thread before a forward; returns the threads it will run."""
        now = self._clock()
        if self._threads == 0:
            self._set(self.max_threads)
            if self.adaptive:
                self._last = self._sampler()
            return self._threads
        if not self.adaptive or self._last is None:
            return self._threads
        if self._ended is not None and now - self._ended > RESUME_GAP_S:
            self._ended = None
            self._last = self._sampler() or self._last  # resumed after idling: the window starts now
            return self._threads
        if now - self._last.wall_s < self.interval_s:
            return self._threads
        sample, last = self._sampler(), self._last
        if sample is None:
            return self._threads
        self._last = sample
        self._free = free_cpus(last, sample, self._num_cpus)
        # Hysteresis: one more thread needs 0.75 of a core free beyond the current ones, keeping one needs 0.5,
        # so a count measured near a boundary does not flap.
        keep = math.floor(self._free + 0.5)
        grow = math.floor(self._free + 0.25)
        if keep < self._threads:
            target = max(1, keep)
        else:
            target = min(self.max_threads, max(grow, self._threads))
        if target != self._threads:
            self._set(target)
        return self._threads

    def finished(self) -> None:
        """Call on the engine thread after a forward."""
        if self.adaptive:
            self._ended = self._clock()

    def _set(self, threads: int) -> None:
        self._apply(threads)
        self._threads = threads
