"""benchmarks/gpu_clocks.py: the nvidia-smi samples of a timed run, summarised (parsing runs on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_clocks import ClockSampler, machine_line, reason_names, summarize_samples


def test_samples_summarise_to_median_range_and_every_reason_seen() -> None:
    lines = [
        "1980, 3201, 650.5, 61, 0x0000000000000000",
        "1755, 3201, 699.0, 66, 0x0000000000000004",  # power capped
        "1980, 3201, 120.1, 58, 0x0000000000000001",  # idle between phases: not a reason that slows a kernel
        "[Unknown Error]",
        "1830, 3201",  # cut off by the terminate
    ]
    info = summarize_samples(lines)
    assert info["samples"] == "3"
    assert info["sm_clock_mhz"] == "1980 (1755-1980)"
    assert info["power_w"] == "650 (max 699)"
    assert info["temperature_c"] == "66 max"
    assert info["clock_reasons"] == "software power cap"
    assert summarize_samples(["0x1", ""]) == {}


def test_reason_bits_are_named_and_unknown_bits_kept() -> None:
    assert reason_names(0x4 | 0x40) == ["software power cap", "hardware thermal"]
    assert reason_names(0x1000 | 0x8) == ["hardware slowdown", "0x1000"]
    assert reason_names(0) == []


def test_without_a_gpu_the_line_names_the_host_only() -> None:
    with ClockSampler() as clocks:
        pass
    info = clocks.info()
    line = machine_line(info)
    assert line.startswith("machine: host ") and line.endswith(f"{info['host_cores']} cores")
    sampled = {**info, **summarize_samples(["1980, 3201, 650, 61, 0x0"]), "max_sm_clock_mhz": "1980"}
    assert "SM clock 1980 (1980-1980) of max 1980 MHz" in machine_line(sampled)
