"""The project installed as a user installs it: from a copy of its sources, into a fresh virtual environment."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.servers import ROOT

SOURCE_FILES = ("pyproject.toml", "README.md")
SOURCE_PACKAGES = ("client", "protocol", "service", "export", "tools")
"""What the sdist takes from the checkout (pyproject.toml's packages); the Dockerfile's build stages take the same
but `tools` (the image measures nothing)."""


def copy_project_source(destination: Path) -> Path:
    """A copy of the project's sources (as an sdist holds them) at `destination`, without bytecode."""
    destination.mkdir(parents=True)
    for name in SOURCE_FILES:
        shutil.copy(ROOT / name, destination / name)
    for package in SOURCE_PACKAGES:
        shutil.copytree(ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def fresh_environment(folder: Path, interpreter: str = sys.executable) -> Path:
    """A new virtual environment at `folder` made by `interpreter`; its python."""
    subprocess.run([interpreter, "-m", "venv", str(folder)], check=True, timeout=120)
    return folder / "bin" / "python"


def pip_install(python: Path, *arguments: str, timeout_s: float = 600) -> None:
    """`pip install` into an environment; AssertionError with pip's output if it fails."""
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert install.returncode == 0, install.stdout + install.stderr
