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
