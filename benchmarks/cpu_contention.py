"""A command's wall time alone and beside busy processes: how a CPU run fares on a machine shared with other jobs.

    python benchmarks/cpu_contention.py --busy 0 2 -- hybridflow train trainer.default_local_dir=/tmp/demo
    python benchmarks/cpu_contention.py --busy 0 2 --env GOMP_SPINCOUNT=300000 --env OMP_NUM_THREADS=2 -- hybridflow train ...

For each ``--busy N`` the command runs beside N processes that each spin one core in a Python loop (N = 0:
alone), started ``--settle-s`` seconds before it (60 by default: the 1-minute load average, which the thread
policy reads, then shows them, as it would show jobs already running). Each row gives the command's wall time,
the CPU time it used (its own and its children's, not the busy loops') and their ratio: a run whose OpenMP
threads spin on cores other processes hold burns far more CPU than its wall time needs (issue 60: 26
CPU-minutes for ~2.5 minutes of work).

Before and after the thread policy (``hybridflow/utils/threads.py``): run the same command from a checkout
without it (``--env PYTHONPATH=/path/to/old/checkout``), or emulate it with ``--env GOMP_SPINCOUNT=300000``
(libgomp's default spinning: an explicit spin count outlasts the passive policy) and ``--env
OMP_NUM_THREADS=<cores>`` (torch's default count, kept as the user's). ``--out FILE`` writes the rows as JSON.
Run it on an otherwise idle machine: other jobs are contention too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SPIN = "while True:\n    pass\n"


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning one core each."""
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the busy processes (each by its own id)."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_timed(command: list[str], env: dict[str, str], log: Path | None) -> dict[str, float]:
    """Run ``command``; its exit status, wall seconds and CPU seconds (its own and its children's)."""
    out = log.open("w") if log is not None else subprocess.DEVNULL
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this command's process tree only
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if log is not None:
        out.close()
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "returncode": proc.returncode,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_wall": cpu / max(wall, 1e-9),
    }


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs as a dict (an empty value is kept: it is a setting too)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env {pair!r}: give KEY=VALUE")
        out[key] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--busy", type=int, nargs="+", default=[0, 2], help="busy processes beside it (0: alone)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=60.0, help="seconds the busy loops run before the command"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per busy count")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the command's environment")
    parser.add_argument("--logs", type=Path, default=None, help="directory for each run's output")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to time")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to time after --")
    env = {**os.environ, **parse_env(args.env)}
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"command: {' '.join(command)}; cores: {os.cpu_count()}; env: {parse_env(args.env) or 'as is'}")
    print(f"{'busy':>4}  {'run':>3}  {'wall s':>8}  {'cpu s':>8}  {'cpu/wall':>8}  exit")
    for n in args.busy:
        for r in range(args.repeats):
            busy = start_busy(n)
            try:
                if n:
                    time.sleep(args.settle_s)
                log = args.logs / f"busy{n}_run{r}.log" if args.logs is not None else None
                row = {"busy": n, "run": r, **run_timed(command, env, log), "load_at_end": os.getloadavg()[0]}
            finally:
                stop(busy)
            rows.append(row)
            print(
                f"{n:>4}  {r:>3}  {row['wall_s']:>8.1f}  {row['cpu_s']:>8.1f}  {row['cpu_per_wall']:>8.2f}  "
                f"{row['returncode']}",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"command": command, "env": parse_env(args.env), "rows": rows}, indent=1)
        )
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
