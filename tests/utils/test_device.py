"""trainer.device picks the device type of a process: the engines, the process group and the CLI honour it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.cli.main import main
from hybridflow.engine.parallel.parallelize import default_device
from hybridflow.utils.device import cuda_in_use, use_device_type
from hybridflow.utils.dist import default_backend


@pytest.fixture(autouse=True)
def back_to_auto():
    yield
    use_device_type("auto")


def test_cpu_keeps_the_process_off_the_gpu() -> None:
    use_device_type("cpu")
    assert not cuda_in_use()
    assert default_device() == torch.device("cpu") and default_backend() == "gloo"
    use_device_type("auto")
    assert cuda_in_use() == torch.cuda.is_available()


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"trainer\.device: unknown value 'tpu'"):
        use_device_type("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_cuda_without_a_gpu_stops_the_cli_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "trainer.device=cuda", "trainer.total_training_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.device=cuda, but this process sees no CUDA device" in err
    assert "set trainer.device=auto" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="pass --device auto"):
        use_device_type("cuda", "--device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_a_gpu_memory_cap_on_a_cpu_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``trainer.gpu_memory_gb`` caps a GPU: on the CPU it would do nothing, so the run stops and says so."""
    assert (
        main(["train", "trainer.device=cpu", "trainer.gpu_memory_gb=80", "trainer.total_training_steps=1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "trainer.gpu_memory_gb=80 caps a GPU's memory, but this process computes on the CPU" in err
    assert "remove trainer.gpu_memory_gb" in err and "Traceback" not in err
    assert main(["train", "trainer.gpu_memory_gb=0", "trainer.total_training_steps=1"]) == 2
    assert "trainer.gpu_memory_gb" in capsys.readouterr().err  # above 0 or unset


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cap_makes_a_bigger_allocation_run_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is the caching allocator's limit: past it an allocation fails as on a smaller GPU."""
    from hybridflow.utils import device
    from hybridflow.utils.device import cap_gpu_memory, gpu_memory_limit

    monkeypatch.setattr(device, "_gpu_cap", None)  # restored after the test, for the next GPU tests
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        cap_gpu_memory(4)
        assert gpu_memory_limit(0) == 4 * 10**9
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(5 * 10**9, dtype=torch.uint8, device="cuda")
        with pytest.raises(ValueError, match="is more than this GPU's"):
            cap_gpu_memory(total / 1e9 + 1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
