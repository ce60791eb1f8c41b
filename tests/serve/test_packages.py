"""The endpoint's packages are optional (the ``serve`` extra): a checkout without aiohttp and openai trains,
and asking for the endpoint names the install command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("aiohttp", "openai"):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Block())
    """
)


def run_without_packages(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_the_trainer_imports_without_the_endpoint_packages() -> None:
    proc = run_without_packages(
        """
        import hybridflow.workers.actor, hybridflow.trainer.ppo, hybridflow.cli.main
        assert "aiohttp" not in sys.modules and "openai" not in sys.modules
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_asking_for_the_endpoint_without_them_names_the_install() -> None:
    proc = run_without_packages(
        """
        import importlib.util
        importlib.util.find_spec = lambda name, *a: None if name in ("aiohttp", "openai") else object()
        from hybridflow.serve import require_packages
        from hybridflow.utils.errors import UserError
        try:
            require_packages("rollout.harness")
        except UserError as e:
            print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout.harness needs" in proc.stdout and 'pip install "hybridflow[serve]"' in proc.stdout
