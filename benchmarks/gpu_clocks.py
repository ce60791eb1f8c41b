"""What the GPU ran at while a benchmark timed it: SM and memory clocks, power, temperature, throttle reasons.

Step times of the same code differ between machine starts of the shared H200 (RESULTS.md), so the GRPO step
benchmark samples ``nvidia-smi`` every 200 ms *during* its timed steps (a snapshot taken afterwards sees an
idle GPU) and reports the spread next to the figures. Without CUDA or ``nvidia-smi`` it records the host only.
``cap_gpu_memory`` (``--gpu-memory-gb``) lets a benchmark allocate only part of the GPU, as a smaller one would.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

# NVML's clock-event ("throttle") reason bits, as nvidia-smi prints them in hex.
REASONS = {
    0x1: "idle",
    0x2: "application clocks",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
    0x100: "display clocks",
}
FIELDS = ["clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"]
REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]  # new name, old name


def host() -> dict[str, str]:
    """The host CPU's model name and core count."""
    info = {"host_cpu": platform.processor() or platform.machine(), "host_cores": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["host_cpu"] = names[0] if names else info["host_cpu"]
    except OSError:
        pass
    return info


def reason_names(mask: int) -> list[str]:
    """The names of the reason bits set in ``mask`` (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize_samples(lines: list[str]) -> dict[str, str]:
    """Median and range of the sampled clocks and power, the hottest reading and every reason seen.

    ``lines`` are nvidia-smi's csv rows (noheader, nounits) of FIELDS plus one reason column; rows that do
    not parse (an error line, a cut-off last row) are skipped.
    """
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append(([float(p) for p in parts[:4]], int(parts[4], 16)))
        except (ValueError, IndexError):
            continue
    if not rows:
        return {}
    sm, mem, power, temp = ([r[0][i] for r in rows] for i in range(4))
    mask = 0
    for _, bits in rows:
        mask |= bits
    return {
        "samples": str(len(rows)),
        "sm_clock_mhz": f"{statistics.median(sm):.0f} ({min(sm):.0f}-{max(sm):.0f})",
        "mem_clock_mhz": f"{statistics.median(mem):.0f}",
        "power_w": f"{statistics.median(power):.0f} (max {max(power):.0f})",
        "temperature_c": f"{max(temp):.0f} max",
        "clock_reasons": ", ".join(n for n in reason_names(mask) if n != "idle") or "none",
    }


def _query(fields: list[str], extra: list[str]) -> subprocess.CompletedProcess:
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


class ClockSampler:
    """``with ClockSampler() as s: ...`` samples the GPU while the block runs; ``s.info()`` summarises it."""

    def __init__(self, interval_ms: int = 200) -> None:
        self.interval_ms = interval_ms
        self.fields: list[str] | None = None
        self.max_sm = ""
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._lines: list[str] = []

    def __enter__(self) -> ClockSampler:
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            try:
                self._start()
            except (OSError, subprocess.SubprocessError):
                self._proc = None
        return self

    def _start(self) -> None:
        for reason in REASON_FIELDS:  # older drivers know only the old name; an unknown field fails the query
            probe = _query(["clocks.max.sm", *FIELDS, reason], [])
            if probe.returncode == 0 and probe.stdout.strip():
                self.fields = [*FIELDS, reason]
                self.max_sm = probe.stdout.split(",")[0].strip()
                break
        if self.fields is None:
            return
        cmd = ["nvidia-smi", f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits"]
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (read and closed in __exit__)
        self._proc = subprocess.Popen(
            [*cmd, f"-lms={self.interval_ms}"], stdout=self._log, stderr=subprocess.DEVNULL
        )

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=20)
        if self._log is not None:
            self._log.seek(0)
            self._lines = self._log.read().splitlines()
            self._log.close()

    def info(self) -> dict[str, str]:
        """The host, and the sampled GPU figures when there were any."""
        info = host()
        gpu = summarize_samples(self._lines)
        if gpu:
            info.update(gpu, max_sm_clock_mhz=self.max_sm)
        return info


def machine_line(info: dict[str, str]) -> str:
    """One line for ``ClockSampler.info()``: what can differ between two machine starts."""
    gpu = ""
    if "sm_clock_mhz" in info:
        gpu = (
            f"SM clock {info['sm_clock_mhz']} of max {info['max_sm_clock_mhz']} MHz, memory clock "
            f"{info['mem_clock_mhz']} MHz, {info['power_w']} W, {info['temperature_c']} C, clock reasons: "
            f"{info['clock_reasons']} ({info['samples']} samples while timed); "
        )
    return f"machine: {gpu}host {info['host_cpu']}, {info['host_cores']} cores"


def gpu_memory_gb(text: str) -> float:
    """``--gpu-memory-gb``: a number of GiB above 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected GiB of GPU memory above 0, e.g. 80; got {text!r}")
    return value


def cap_gpu_memory(gib: float | None) -> None:
    """Let this process allocate at most ``gib`` GiB of the GPU (a smaller GPU measured on a bigger one).

    Call it before anything is allocated on the GPU: the caching allocator refuses any allocation past the
    cap with an out-of-memory error, as the smaller GPU would.
    """
    if gib is None:
        return
    if not torch.cuda.is_available():
        sys.exit("error: --gpu-memory-gb caps a GPU's memory, and there is no GPU here")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        sys.exit(f"error: --gpu-memory-gb {gib:g} is more than this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
