"""Child Python processes that run this repository's code."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH and what PYTHONPATH
    held after it (packages installed there stay importable), plus `extra`."""
    held = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([held] if held else [])), **extra}
