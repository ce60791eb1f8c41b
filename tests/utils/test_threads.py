"""The CPU thread policy: passive OpenMP waits set before torch loads, and a thread count sized to the CPUs
this process may use, the cores other processes are busy on and the ranks on the host."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.utils import threads
from hybridflow.utils.threads import (
    MachineView,
    allowed_cpus,
    cgroup_cpu_limit,
    cgroup_v1_cpus,
    cgroup_v2_cpus,
    choose_threads,
    others_load,
    own_load,
    passive_wait_env,
    plan_threads,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_passive_wait_policy_is_set_unless_the_user_chose_one() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert passive_wait_env(env) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["GOMP_SPINCOUNT"] == "0"
    assert passive_wait_env(env) == {}  # again: nothing to add
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert passive_wait_env(mine) == {} and mine == {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's, untouched
    spin = {"GOMP_SPINCOUNT": "10000"}
    assert passive_wait_env(spin) == {"OMP_WAIT_POLICY": "PASSIVE"} and spin["GOMP_SPINCOUNT"] == "10000"


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("200000 100000\n", 2.0), ("150000 100000", 1.5), ("max 100000\n", None), ("50000", 0.5), ("", None)],
)
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert cgroup_v2_cpus(text) == cpus


@pytest.mark.parametrize(
    ("quota", "period", "cpus"), [("400000\n", "100000\n", 4.0), ("-1\n", "100000\n", None), ("x", "1", None)]
)
def test_cgroup_v1_cfs_quota(quota: str, period: str, cpus: float | None) -> None:
    assert cgroup_v1_cpus(quota, period) == cpus


def test_the_smallest_quota_of_the_cgroup_and_its_parents_applies(tmp_path: Path) -> None:
    # cgroup v2: the job's own cgroup has no limit, its parent slice allows 3 CPUs, the root 6.
    (tmp_path / "user.slice" / "job").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("600000 100000\n")
    (tmp_path / "user.slice" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "user.slice" / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit("0::/user.slice/job\n", tmp_path) == 3.0
    # cgroup v1 (a hybrid host: the v2 line names a cgroup without cpu.max), quota in the cpu controller.
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    text = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_limit(text, v1) == 2.5
    assert cgroup_cpu_limit("4:cpu,cpuacct:/\n0::/\n", tmp_path / "missing") is None  # nothing readable


def test_allowed_cpus_is_the_affinity_capped_by_the_quota() -> None:
    assert allowed_cpus(8, None) == 8
    assert allowed_cpus(8, 2.5) == 2  # a 2.5-CPU quota keeps 2 threads busy without throttling
    assert allowed_cpus(2, 16.0) == 2
    assert allowed_cpus(8, 0.5) == 1


def test_this_process_own_load_is_not_counted_as_others() -> None:
    assert own_load(cpu_s=0.5, wall_s=1.0) == pytest.approx(0.5 * (1 - 2.718281828 ** (-1 / 60)), rel=1e-6)
    assert own_load(cpu_s=600.0, wall_s=600.0) == pytest.approx(
        1.0, abs=1e-4
    )  # 10 min at one core: all of it
    assert own_load(0.0, 0.0) == 0.0
    assert others_load(2.4, 1.0) == pytest.approx(1.4)
    assert others_load(0.2, 1.0) == 0.0
    assert others_load(None, 1.0) is None


@pytest.mark.parametrize(
    ("allowed", "machine", "busy", "ranks", "expected"),
    [
        (2, 2, 0.3, 1, 2),  # an idle 2-core machine: both cores
        (2, 2, 1.2, 1, 1),  # another job busy on one core: one thread, never waiting on the busy core
        (2, 2, 3.0, 1, 1),  # everything busy: still one thread
        (2, 2, None, 1, 2),  # load unknown: the allowed CPUs
        (16, 16, 4.0, 1, 12),
        (16, 16, 0.0, 4, 4),  # four ranks on the host share the cores
        (16, 16, 8.0, 4, 2),
        (4, 64, 40.0, 1, 4),  # a 4-CPU container on a busy 64-core host: its own quota bounds it
        (2, 2, 0.0, 8, 1),  # more ranks than cores: one thread each
    ],
)
def test_choose_threads(allowed: int, machine: int, busy: float | None, ranks: int, expected: int) -> None:
    assert choose_threads(allowed, machine, busy, ranks) == expected


def view(**kw) -> MachineView:
    base = dict(affinity=2, quota=None, machine_cpus=2, load1=0.3, own=0.0, ranks=1)
    return MachineView(**{**base, **kw})


def test_the_plan_says_why() -> None:
    assert plan_threads(0, {}, view()).line() == (
        "cpu threads: 2 (2 CPUs allowed, load 0.3 from other processes, 1 rank on this host)"
    )
    busy = plan_threads(0, {}, view(load1=2.1, own=0.9, quota=2.0, ranks=2))
    assert busy.threads == 1
    assert busy.why == "2 CPUs allowed, cgroup quota 2, load 1.2 from other processes, 2 ranks on this host"
    assert (
        plan_threads(3, {"OMP_NUM_THREADS": "1"}, view()).line() == "cpu threads: 3 (trainer.cpu_threads=3)"
    )
    kept = plan_threads(0, {"OMP_NUM_THREADS": "4"}, view())
    assert kept.threads == 4 and kept.why.startswith("OMP_NUM_THREADS=4 in the environment")
    assert plan_threads(0, {"OMP_NUM_THREADS": "junk"}, view()).threads == 2  # not a count: auto
    assert plan_threads(0, {}, view(load1=None)).why.endswith("load unknown, 1 rank on this host")


def test_threads_are_sized_once_per_process_and_only_on_cpu(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_decided", None)
    monkeypatch.setattr(threads, "read_machine", lambda: view(affinity=3, machine_cpus=3, load1=0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert threads.configure_cpu_threads(0, on_cpu=False) is None  # a GPU run keeps torch's count
        assert torch.get_num_threads() == before
        with caplog.at_level("INFO", logger="hybridflow.utils.threads"):
            assert threads.configure_cpu_threads(0, on_cpu=True).threads == 3
            assert torch.get_num_threads() == 3
            monkeypatch.setattr(threads, "read_machine", lambda: view(load1=5.0))
            assert threads.configure_cpu_threads(0, on_cpu=True).threads == 3  # decided already
            assert threads.configure_cpu_threads(1, on_cpu=True).threads == 1  # a count of the config's own
            assert torch.get_num_threads() == 1
        assert [r.getMessage() for r in caplog.records] == [
            "cpu threads: 3 (3 CPUs allowed, load 0.0 from other processes, 1 rank on this host)",
            "cpu threads: 1 (trainer.cpu_threads=1)",
        ]
    finally:
        torch.set_num_threads(before)


def test_a_resume_keeps_the_count_its_checkpoint_computed_with(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_decided", (0, threads.ThreadPlan(1, "auto")))  # the load said 1 this time
    try:
        with caplog.at_level("INFO", logger="hybridflow.utils.threads"):
            assert (
                threads.keep_resumed_threads(None, 0, on_cpu=True) is None
            )  # saved before there was a count
            assert threads.keep_resumed_threads(2, 0, on_cpu=False) is None  # a GPU run
            assert threads.keep_resumed_threads(2, 3, on_cpu=True) is None  # trainer.cpu_threads=3 wins
            kept = threads.keep_resumed_threads(2, 0, on_cpu=True)
            assert kept is not None and kept.threads == 2 and torch.get_num_threads() == 2
            assert threads.current_cpu_threads() == 2
            assert threads.keep_resumed_threads(2, 0, on_cpu=True) is None  # already so
            monkeypatch.setenv("OMP_NUM_THREADS", "1")
            assert threads.keep_resumed_threads(1, 0, on_cpu=True) is None  # the environment's count wins
        assert [r.getMessage() for r in caplog.records] == [
            "cpu threads: 2 (the checkpoint's count, so that the run goes on computing as it did; "
            "trainer.cpu_threads=N sets another)"
        ]
    finally:
        torch.set_num_threads(before)


# Runs the command line as the `hybridflow` script does, noting the wait policy in the environment at the moment
# torch is first imported (OpenMP reads it then), and torch's thread count at the end.
WATCHER = """
import importlib.abc, os, sys
class Watch(importlib.abc.MetaPathFinder):
    seen = False
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not Watch.seen:
            Watch.seen = True
            print("TORCH " + os.environ.get("OMP_WAIT_POLICY", "-") + " " + os.environ.get("GOMP_SPINCOUNT", "-"))
        return None
sys.meta_path.insert(0, Watch())
from hybridflow.cli.main import main
code = main(sys.argv[1:])
import torch
print("THREADS", torch.get_num_threads())
sys.exit(code)
"""


def test_the_cli_waits_passively_from_the_start_and_sizes_its_threads(tmp_path: Path) -> None:
    from hybridflow.models import build_tiny_model_and_tokenizer

    build_tiny_model_and_tokenizer(out_dir=tmp_path / "base", hidden_size=32, num_hidden_layers=1)
    rows = [{"prompt": f"{i}+{i % 3}=", "response": f"#### {i + i % 3}"} for i in range(6)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drop = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), LOCAL_WORLD_SIZE="2")
    args = [
        "sft",
        f"model.path={tmp_path / 'base'}",
        f"data.train_files=[{data}]",
        "data.train_batch_size=3",
        "actor.ppo_mini_batch_size=3",
        "trainer.total_training_steps=1",
        "trainer.device=cpu",
        "--out",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        [sys.executable, "-c", WATCHER, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TORCH PASSIVE 0" in done.stdout  # in the environment before torch (and its libgomp) loaded
    said = r"cpu threads: (\d+) \((\d+) CPUs allowed(, cgroup quota [\d.]+)?, load [\d.]+ from other processes, 2 ranks"
    line = re.search(said, done.stderr)
    assert line is not None, done.stderr[-3000:]
    chosen, allowed = int(line[1]), int(line[2])
    assert allowed <= len(os.sched_getaffinity(0)) and 1 <= chosen <= max(1, allowed // 2)
    assert f"THREADS {chosen}" in done.stdout  # what torch computes with
    assert done.stderr.count("cpu threads:") == 1
    # stderr is no terminal here: transformers' "Loading weights" bar (carriage returns in a log file) is off.
    assert "Loading weights" not in done.stderr and "\r" not in done.stderr
