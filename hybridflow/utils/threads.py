"""How many CPU threads torch computes with, and how they wait: runs that stay fast on a shared machine.

Two things make a CPU run crawl when other jobs share the machine. torch's OpenMP threads spin between
parallel regions (libgomp spins 300,000 times by default before it sleeps), so a thread that finished its
share burns a core another process needs; and torch starts one thread per core even when other processes
are busy on most of them, so each parallel region waits for its thread that got no core. Measured on a
2-core machine beside other jobs: the README's demo took 4,193 s instead of about 150 s, its process using 26
CPU-minutes, while a one-thread run beside it kept its pace.

So: OpenMP waits passively (``OMP_WAIT_POLICY=PASSIVE``; ``GOMP_SPINCOUNT=0`` for GNU libgomp), which must be in
the environment before torch is first imported (the command line sets it first thing, and every worker
process inherits it; a value the user set is kept); and a CPU run sizes torch's intra-op threads to the CPUs
this process may use (its affinity mask and its cgroup's CPU quota), less the cores other processes are busy on
(the 1-minute load average, less this process's own share of it), split between the ranks on this host
(``LOCAL_WORLD_SIZE``). ``trainer.cpu_threads=N`` sets the count; ``OMP_NUM_THREADS`` in the environment is kept
as the user's (or the launcher's: torchrun sets 1 for several processes per host). On a GPU torch keeps its
own count. The decision is taken once per process and logged once; a resumed run takes the count its checkpoint
was saved with (float32 results may move in their last bits with the count).

The functions that decide are pure (affinity sizes, cgroup file contents, load averages in, a count out);
``configure_cpu_threads`` reads the machine and applies the result.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from hybridflow.utils.host import ranks_on_host

logger = logging.getLogger(__name__)

# OpenMP's wait policy for every process of a run. libgomp reads GOMP_SPINCOUNT (how long a waiting thread spins
# before it sleeps); PASSIVE already means 0 there, the explicit value keeps it so for a runtime that reads only it.
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
LOAD_WINDOW_S = 60.0  # the time constant of the 1-minute load average


def passive_wait_env(env: MutableMapping[str, str]) -> dict[str, str]:
    """Put OpenMP's passive wait policy in ``env`` unless the user chose a wait policy; returns what was set.

    A user who set ``OMP_WAIT_POLICY`` (even ACTIVE) keeps it, with whatever ``GOMP_SPINCOUNT`` they set; a
    ``GOMP_SPINCOUNT`` of their own is kept too. Call it before torch is first imported: OpenMP reads these once.
    """
    if "OMP_WAIT_POLICY" in env:
        return {}
    added = {key: value for key, value in PASSIVE_WAIT.items() if key not in env}
    env.update(added)
    return added


def cgroup_v2_cpus(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 ``cpu.max`` allows ("200000 100000" -> 2.0); None without a quota ("max ...")."""
    fields = cpu_max.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_v1_cpus(quota_us: str, period_us: str) -> float | None:
    """The CPUs a cgroup v1 CFS quota allows (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None for -1."""
    try:
        quota, period = int(quota_us.strip()), int(period_us.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/path`` and each of its parent directories up to ``root`` (a limit anywhere above applies too)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(self_cgroup: str, root: Path) -> float | None:
    """The smallest CPU quota over this process's cgroups and their parents; None when none is set.

    ``self_cgroup`` is the text of ``/proc/self/cgroup`` (``0::/path`` for cgroup v2, ``N:cpu,cpuacct:/path``
    for v1) and ``root`` the cgroup mount (``/sys/fs/cgroup``). Inside a container the paths are the
    container's own, and its limit lies at the mount's top: both are looked at.
    """
    limits: list[float] = []
    for line in self_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: one unified hierarchy
            for d in _ancestors(root, path):
                limits += [v for v in [_read_v2(d / "cpu.max")] if v is not None]
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                for d in _ancestors(mount, path):
                    limits += [v for v in [_read_v1(d)] if v is not None]
    return min(limits) if limits else None


def _read_v2(path: Path) -> float | None:
    try:
        return cgroup_v2_cpus(path.read_text())
    except OSError:
        return None


def _read_v1(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text()
        period = (directory / "cpu.cfs_period_us").read_text()
    except OSError:
        return None
    return cgroup_v1_cpus(quota, period)


def allowed_cpus(affinity: int, quota: float | None) -> int:
    """The CPUs this process may use: its affinity mask's size, at most its cgroup quota (at least 1)."""
    if quota is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(quota)))


def own_load(cpu_s: float, wall_s: float, window_s: float = LOAD_WINDOW_S) -> float:
    """This process's own share of the load average: its mean CPU rate, weighted by how much of the
    average's window its life spans (a process that just started has barely raised the 1-minute load)."""
    if wall_s <= 0:
        return 0.0
    rate = cpu_s / wall_s  # threads busy on average over the process's life
    return rate * (1.0 - math.exp(-wall_s / window_s))


def others_load(load1: float | None, own: float) -> float | None:
    """The cores other processes are busy on: the 1-minute load average less this process's share."""
    return None if load1 is None else max(0.0, load1 - own)


def choose_threads(allowed: int, machine_cpus: int, busy: float | None, ranks: int) -> int:
    """Intra-op threads for one rank: the allowed CPUs, at most the cores nobody else is busy on (rounded to
    the nearest, at least one), split between the ``ranks`` of this job on this host."""
    budget = allowed
    if busy is not None:
        idle = machine_cpus - busy
        budget = min(allowed, max(1, int(idle + 0.5)))
    return max(1, budget // max(1, ranks))


@dataclass(frozen=True)
class ThreadPlan:
    """The intra-op thread count chosen for this process, and why (the log line says both)."""

    threads: int
    why: str

    def line(self) -> str:
        """The log line, e.g. ``cpu threads: 2 (2 CPUs allowed, load 0.3 from other processes, 1 rank on this
        host)``."""
        return f"cpu threads: {self.threads} ({self.why})"


@dataclass(frozen=True)
class MachineView:
    """What this process sees of the machine: the inputs of ``plan_threads``."""

    affinity: int  # CPUs in this process's affinity mask
    quota: float | None  # its cgroup's CPU quota, None when unlimited
    machine_cpus: int  # CPUs of the machine (the load average counts over all of them)
    load1: float | None  # the 1-minute load average, None where unknown
    own: float  # this process's own share of that load
    ranks: int  # this job's processes on this host


def plan_threads(setting: int, env: Mapping[str, str], view: MachineView) -> ThreadPlan:
    """The thread count for ``trainer.cpu_threads=setting`` (0: auto), the environment and the machine."""
    if setting > 0:
        return ThreadPlan(setting, f"trainer.cpu_threads={setting}")
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return ThreadPlan(
            int(given),
            f"OMP_NUM_THREADS={given} in the environment; trainer.cpu_threads=N sets another count",
        )
    allowed = allowed_cpus(view.affinity, view.quota)
    busy = others_load(view.load1, view.own)
    threads = choose_threads(allowed, view.machine_cpus, busy, view.ranks)
    quota = f", cgroup quota {view.quota:g}" if view.quota is not None else ""
    load = f"load {busy:.1f} from other processes" if busy is not None else "load unknown"
    ranks = f"{view.ranks} rank{'s' if view.ranks != 1 else ''} on this host"
    return ThreadPlan(threads, f"{allowed} CPUs allowed{quota}, {load}, {ranks}")


def _process_times() -> tuple[float, float]:
    """(CPU seconds, wall seconds) this process has used since it started; (0, 0) where unknown."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = os.sysconf("SC_CLK_TCK")
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return time.process_time(), max(0.0, uptime - start_ticks / ticks)


def read_machine() -> MachineView:
    """What this process sees now: affinity, cgroup quota, load average and its own share, ranks on host."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota = cgroup_cpu_limit(Path("/proc/self/cgroup").read_text(), Path("/sys/fs/cgroup"))
    except OSError:
        quota = None
    try:
        load1: float | None = os.getloadavg()[0]
    except (OSError, AttributeError):
        load1 = None
    cpu_s, wall_s = _process_times()
    return MachineView(
        affinity, quota, os.cpu_count() or affinity, load1, own_load(cpu_s, wall_s), ranks_on_host()
    )


_decided: tuple[int, ThreadPlan] | None = None  # (the setting it was decided for, the plan) in this process


def configure_cpu_threads(setting: int, on_cpu: bool) -> ThreadPlan | None:
    """Size torch's intra-op threads for a CPU run (``trainer.cpu_threads``, 0 = auto), once per process.

    Logs the decision the first time (rank 0's log shows it). A later job in the same process (the demo's
    RL phase after its warm-up, a second notebook run) keeps it unless it sets another count: the load
    average then holds this process's own work. On a GPU torch keeps its own count and None is returned.
    """
    global _decided
    if not on_cpu:
        return None
    if _decided is not None and (setting == 0 or setting == _decided[0]):
        return _decided[1]
    import torch

    plan = plan_threads(setting, os.environ, read_machine())
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    _decided = (setting, plan)
    logger.info("%s", plan.line())
    return plan


def current_cpu_threads() -> int | None:
    """The count ``configure_cpu_threads`` chose in this process; None where it chose none (a GPU run)."""
    return None if _decided is None else _decided[1].threads


def keep_resumed_threads(saved: int | None, setting: int, on_cpu: bool) -> ThreadPlan | None:
    """A resumed CPU run with the automatic count computes with the count its checkpoint was saved with.

    float32 results on the CPU may move in their last bits with the thread count, and the automatic count
    follows the machine's load at each start: taking the saved one keeps a resumed run on the numbers of an
    uninterrupted one. A count the config or ``OMP_NUM_THREADS`` sets wins. Returns the plan when it changed.
    """
    global _decided
    if not on_cpu or not saved or setting > 0 or "OMP_NUM_THREADS" in os.environ:
        return None
    if current_cpu_threads() == saved:
        return None
    import torch

    plan = ThreadPlan(
        saved,
        "the checkpoint's count, so that the run goes on computing as it did; "
        "trainer.cpu_threads=N sets another",
    )
    torch.set_num_threads(saved)
    _decided = (0, plan)
    logger.info("%s", plan.line())
    return plan
