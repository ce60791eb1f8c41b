"""The OpenAI-compatible endpoint on the paged engine, token-exact episode trajectories and the harness runner
(``rollout.harness``, ``hybridflow serve``). Its HTTP server and client are optional packages (the ``serve``
extra): nothing here imports them until a run asks for the endpoint."""

from __future__ import annotations

import importlib.util

from hybridflow.utils.errors import UserError

PACKAGES = {"aiohttp": "aiohttp>=3.9", "openai": "openai>=1.40"}


def require_packages(what: str) -> None:
    """Raise ``UserError`` naming the install command when the endpoint's packages are missing."""
    missing = [spec for name, spec in PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"{what} needs {' and '.join(missing)}, which are not installed; fix: pip install "
            f'"hybridflow[serve]" (or pip install {" ".join(repr(m) for m in missing)})'
        )
