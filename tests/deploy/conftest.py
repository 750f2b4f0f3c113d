"""Shared fixtures of the deployment tests: the repository layout and the rendered kustomizations."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"

# What `kubectl apply -k` is pointed at, plus the opt-in autoscaling component on top of the cpu
# overlay (rendered through a throw-away kustomization, as a user's overlay would include it).
VARIANTS = ("base", "cpu", "gpu", "cpu+inflight-autoscaling")
VARIANT_DIRS = {"base": "base", "cpu": "overlays/cpu", "gpu": "overlays/gpu"}
COMPONENT = DEPLOY / "components" / "inflight-autoscaling"

Manifest = dict[str, Any]


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it renders the kustomizations (`kubectl kustomize`)")
    return kubectl


def _kustomize(kubectl: str, directory: Path) -> list[Manifest]:
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [document for document in yaml.safe_load_all(result.stdout) if document]


@pytest.fixture(scope="session")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    """Every variant rendered with `kubectl kustomize`, by variant name."""
    kubectl = _kubectl()
    rendered = {name: _kustomize(kubectl, DEPLOY / path) for name, path in VARIANT_DIRS.items()}
    # kustomize refuses absolute paths, so the throw-away overlay refers to the repository relatively.
    overlay = tmp_path_factory.mktemp("inflight-autoscaling")
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(DEPLOY / "overlays" / "cpu", overlay)],
                "components": [os.path.relpath(COMPONENT, overlay)],
            }
        )
    )
    rendered["cpu+inflight-autoscaling"] = _kustomize(kubectl, overlay)
    return rendered


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """Each variant name in turn."""
    return request.param


@pytest.fixture
def manifests(renders: dict[str, list[Manifest]], variant: str) -> list[Manifest]:
    """The rendered objects of one variant."""
    return renders[variant]


@pytest.fixture
def by_kind(manifests: list[Manifest]) -> dict[str, list[Manifest]]:
    """The rendered objects of one variant, grouped by kind."""
    grouped: dict[str, list[Manifest]] = {}
    for item in manifests:
        grouped.setdefault(item["kind"], []).append(item)
    return grouped


@pytest.fixture
def deployment(by_kind: dict[str, list[Manifest]]) -> Manifest:
    """The variant's single Deployment."""
    (found,) = by_kind["Deployment"]
    return found


@pytest.fixture
def container(deployment: Manifest) -> Manifest:
    """The server container of the Deployment."""
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    assert found["name"] == "encoder"
    return found
