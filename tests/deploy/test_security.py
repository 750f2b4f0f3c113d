"""The TLS, mutual TLS and API key components: Secrets mounted so rotation works, settings that match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
API_KEY_EXAMPLE = DEPLOY / "components" / "api-key" / "secret.example.yaml"
HEALTH_PORT = 8003
TLS_SECRET = "encoder-tls"
API_KEY_SECRET = "encoder-api-keys"
GROUP_READ_ONLY = 0o440

Manifest = dict[str, Any]


def _env(container: Manifest) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def _secret_volumes(deployment: Manifest) -> dict[str, Manifest]:
    """Volume name -> its secret source, for the Secret volumes of the pod."""
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    return {volume["name"]: volume["secret"] for volume in volumes if "secret" in volume}


def _mount_of(deployment: Manifest, container: Manifest, secret_name: str) -> Manifest:
    """The container's single mount of the named Secret."""
    names = [name for name, secret in _secret_volumes(deployment).items() if secret["secretName"] == secret_name]
    (name,) = names
    (mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == name]
    return mount


def test_secret_mounts_follow_rotation(deployment: Manifest, container: Manifest, components: set[str]) -> None:
    """Whole-volume, read-only, group-readable mounts: a subPath mount would never see a renewed Secret."""
    secrets = _secret_volumes(deployment)
    expected = set()
    if components & {"tls", "mtls"}:
        expected.add(TLS_SECRET)
    if "api-key" in components:
        expected.add(API_KEY_SECRET)
    assert {secret["secretName"] for secret in secrets.values()} == expected
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in secrets:
            continue
        assert "subPath" not in mount and "subPathExpr" not in mount, mount["name"]
        assert mount["readOnly"] is True, mount["name"]
        assert secrets[mount["name"]]["defaultMode"] == GROUP_READ_ONLY, mount["name"]
        # A missing Secret must keep the pod from starting, not start it without TLS or keys.
        assert not secrets[mount["name"]].get("optional", False), mount["name"]


def test_tls_settings(deployment: Manifest, container: Manifest, components: set[str], tls: bool) -> None:
    env = _env(container)
    tls_names = {"ENCODER_TLS_CERT", "ENCODER_TLS_KEY", "ENCODER_TLS_CLIENT_CA"}
    if not tls:
        assert not tls_names & set(env)
        return
    directory = _mount_of(deployment, container, TLS_SECRET)["mountPath"]
    # The kubernetes.io/tls layout, which cert-manager writes (with the issuing CA as ca.crt).
    assert env["ENCODER_TLS_CERT"] == f"{directory}/tls.crt"
    assert env["ENCODER_TLS_KEY"] == f"{directory}/tls.key"
    if "mtls" in components:
        assert env["ENCODER_TLS_CLIENT_CA"] == f"{directory}/ca.crt"
    else:
        assert "ENCODER_TLS_CLIENT_CA" not in env
    # The probes keep their plaintext health port (set in base for every variant).
    assert env["ENCODER_HEALTH_PORT"] == str(HEALTH_PORT)


def test_api_key_settings(deployment: Manifest, container: Manifest, components: set[str]) -> None:
    env = _env(container)
    if "api-key" not in components:
        assert "ENCODER_API_KEY_FILE" not in env
        return
    mount = _mount_of(deployment, container, API_KEY_SECRET)
    (item,) = _secret_volumes(deployment)[mount["name"]]["items"]
    assert env["ENCODER_API_KEY_FILE"] == f"{mount['mountPath']}/{item['path']}"


def test_cert_manager_certificate(
    deployment: Manifest, container: Manifest, by_kind: dict[str, list[Manifest]], components: set[str]
) -> None:
    if "cert-manager" not in components:
        assert "Certificate" not in by_kind
        return
    (certificate,) = by_kind["Certificate"]
    spec = certificate["spec"]
    # Written into the Secret that the tls component mounts, in the pod's namespace.
    assert spec["secretName"] == TLS_SECRET
    _mount_of(deployment, container, spec["secretName"])
    assert certificate["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert "server auth" in spec["usages"]
    assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert set(spec["issuerRef"]) == {"group", "kind", "name"}
    assert spec["issuerRef"]["group"] == "cert-manager.io"
    assert spec["issuerRef"]["kind"] in {"Issuer", "ClusterIssuer"}
    # Every name a client may dial: each Service, short and fully qualified.
    namespace = deployment["metadata"]["namespace"]
    for service in by_kind["Service"]:
        name = service["metadata"]["name"]
        assert {f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"} <= set(spec["dnsNames"])


def test_api_key_example_is_the_mounted_layout(renders: dict[str, list[Manifest]]) -> None:
    """secret.example.yaml documents the Secret the component mounts (and is valid, but not rendered)."""
    example = yaml.safe_load(API_KEY_EXAMPLE.read_text())
    kubernetes_validate.validate(example, kubernetes_validate.latest_version(), strict=True)
    (deployment,) = [item for item in renders["cpu+api-key"] if item["kind"] == "Deployment"]
    (secret,) = [secret for secret in _secret_volumes(deployment).values() if secret["secretName"] == API_KEY_SECRET]
    assert example["metadata"]["name"] == secret["secretName"]
    (item,) = secret["items"]
    keys = example["stringData"][item["key"]].split()
    assert keys and all("example" in key for key in keys), "the example must hold placeholders, never real keys"
    rendered_names = {(item["kind"], item["metadata"]["name"]) for item in renders["cpu+api-key"]}
    assert ("Secret", API_KEY_SECRET) not in rendered_names
