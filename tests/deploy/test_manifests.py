"""The rendered Kubernetes objects: schemas, and agreement with the server's contract and the image."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GRPC_PORT = 8001
METRICS_PORT = 8002
DEFAULT_DRAIN_TIMEOUT_S = 30
NAMESPACE = "encoder"
MONITORING_API = "monitoring.coreos.com/v1"

# The server's settings as environment variables (flag name upper-cased, dashes to underscores).
SERVER_SETTINGS = {
    f"ENCODER_{flag.upper().replace('-', '_')}"
    for flag in (
        "model-repository",
        "host",
        "grpc-port",
        "metrics-port",
        "device",
        "require-gpu",
        "variant",
        "intra-op-threads",
        "instances",
        "max-queue-delay-us",
        "max-batch-tokens",
        "max-queue-size",
        "drain-timeout-s",
        "max-connection-age-s",
        "log-level",
    )
}

# The oldest Kubernetes the manifests target (native preStop sleep is on by default from 1.30) and
# the newest schema the installed kubernetes-validate ships.
SCHEMA_VERSIONS = ("1.30", kubernetes_validate.latest_version())

Manifest = dict[str, Any]


def _env(container: Manifest) -> dict[str, Manifest]:
    return {item["name"]: item for item in container.get("env", [])}


def _cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _pod_labels(deployment: Manifest) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_variant_objects(manifests: list[Manifest]) -> None:
    kinds = sorted(item["kind"] for item in manifests)
    for kind in (
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Namespace",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PrometheusRule",
        "ServiceAccount",
        "ServiceMonitor",
    ):
        assert kind in kinds
    assert kinds.count("Service") == 2
    for item in manifests:
        expected = None if item["kind"] == "Namespace" else NAMESPACE
        assert item["metadata"].get("namespace") == expected, item["metadata"]["name"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_objects_match_kubernetes_schemas(manifests: list[Manifest], version: str) -> None:
    core = [item for item in manifests if item["apiVersion"] != MONITORING_API]
    assert len(core) >= 9
    for item in core:
        # Strict: unknown (misspelt) fields are errors too. SchemaNotFoundError fails the test.
        try:
            kubernetes_validate.validate(item, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{item['kind']}/{item['metadata']['name']} at {path}: {error.message}")


def test_schema_validation_catches_a_misspelt_field(renders: dict[str, list[Manifest]]) -> None:
    """The validation above can fail: a typo in a probe is rejected."""
    (deployment,) = [item for item in renders["base"] if item["kind"] == "Deployment"]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": GRPC_PORT}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[0], strict=True)


def test_container_ports_are_the_server_defaults(container: Manifest) -> None:
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    # The defaults are used: an override here would have to move every port below with it.
    assert not {"ENCODER_GRPC_PORT", "ENCODER_METRICS_PORT"} & set(_env(container))


def test_settings_are_known_to_the_server(container: Manifest) -> None:
    assert set(_env(container)) <= SERVER_SETTINGS


def test_server_accepts_the_settings(container: Manifest) -> None:
    """The server's own settings loader takes the pod's environment, and listens where the pod expects."""
    from service.settings import load_settings

    environ = {}
    for name, item in _env(container).items():
        if "valueFrom" in item:
            # The kubelet gives limits.cpu with divisor 1 as whole CPUs, rounded up.
            environ[name] = str(math.ceil(_cpu_cores(container["resources"]["limits"]["cpu"])))
        else:
            environ[name] = item["value"]
    settings = load_settings([], environ)
    assert (settings.grpc_port, settings.metrics_port) == (GRPC_PORT, METRICS_PORT)
    assert settings.drain_timeout_s == _drain_timeout_s(container)


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_native_grpc_probes(container: Manifest, probe: str) -> None:
    spec = container[probe]
    assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
    assert spec["grpc"]["port"] == GRPC_PORT
    assert spec["grpc"].get("service", "") == ""


def test_startup_probe_allows_model_loading(container: Manifest) -> None:
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def _drain_timeout_s(container: Manifest) -> int:
    setting = _env(container).get("ENCODER_DRAIN_TIMEOUT_S")
    return int(setting["value"]) if setting else DEFAULT_DRAIN_TIMEOUT_S


def _pre_stop_s(container: Manifest) -> int:
    pre_stop = container["lifecycle"]["preStop"]
    # The native sleep action: the image needs no shell or sleep binary.
    assert set(pre_stop) == {"sleep"}
    return pre_stop["sleep"]["seconds"]


def test_termination_grace_covers_pre_stop_and_drain(deployment: Manifest, container: Manifest) -> None:
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert _pre_stop_s(container) >= 5
    assert grace_s > _pre_stop_s(container) + _drain_timeout_s(container)


def test_liveness_outlasts_a_drain(container: Manifest) -> None:
    """Health is NOT_SERVING while draining: that must not get the container restarted."""
    liveness = container["livenessProbe"]
    tolerated_s = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert tolerated_s > _pre_stop_s(container) + _drain_timeout_s(container)


def test_security_context(deployment: Manifest, container: Manifest) -> None:
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert not context.get("privileged", False)


def test_pod_user_is_the_image_user(deployment: Manifest) -> None:
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert users, "the Dockerfile has no numeric USER"
    uid, gid = users[-1]
    context = deployment["spec"]["template"]["spec"]["securityContext"]
    assert context["runAsUser"] == int(uid)
    assert context["runAsGroup"] == int(gid or uid)


def test_tmp_is_a_writable_empty_dir(deployment: Manifest, container: Manifest) -> None:
    volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
    assert not mount.get("readOnly", False)
    assert "emptyDir" in volumes[mount["name"]]


def test_no_service_links(deployment: Manifest) -> None:
    """A Service named `encoder` would otherwise inject ENCODER_* variables into the server's settings."""
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_replicas_left_to_the_autoscaler(deployment: Manifest) -> None:
    assert "replicas" not in deployment["spec"]


def test_resources_and_threads(container: Manifest) -> None:
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    for resource in ("cpu", "memory"):
        assert requests[resource] == limits[resource], f"{resource}: requests != limits (not Guaranteed QoS)"
    cpu_limit = _cpu_cores(limits["cpu"])
    assert cpu_limit == int(cpu_limit), "a fractional CPU limit throttles a thread pool of whole threads"
    env = _env(container)
    threads = env["ENCODER_INTRA_OP_THREADS"]
    if "valueFrom" in threads:
        reference = threads["valueFrom"]["resourceFieldRef"]
        assert reference["containerName"] == container["name"]
        assert reference["resource"] == "limits.cpu"
        assert reference.get("divisor", "1") in ("1", 1)
        thread_count = int(cpu_limit)
    else:
        thread_count = int(threads["value"])
        assert thread_count == cpu_limit
    instances = int(env.get("ENCODER_INSTANCES", {"value": "1"})["value"])
    assert instances * thread_count <= cpu_limit


def test_device_and_image_per_variant(variant: str, deployment: Manifest, container: Manifest) -> None:
    env = _env(container)
    limits = container["resources"]["limits"]
    if variant == "gpu":
        assert env.get("ENCODER_DEVICE", {"value": "auto"})["value"] == "auto"
        assert env["ENCODER_REQUIRE_GPU"]["value"] == "true"
        assert str(limits["nvidia.com/gpu"]) == "1"
        assert str(container["resources"]["requests"].get("nvidia.com/gpu", 1)) == "1"
        assert "cuda" in container["image"].rsplit(":", 1)[1]
        tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    else:
        assert "nvidia.com/gpu" not in limits
        assert "ENCODER_REQUIRE_GPU" not in env
    if variant.startswith("cpu"):
        assert env["ENCODER_DEVICE"]["value"] == "cpu"
        assert container["image"].endswith("-cpu")


def test_services(by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
    services = {service["metadata"]["name"]: service["spec"] for service in by_kind["Service"]}
    assert set(services) == {"encoder", "encoder-headless"}
    for spec in services.values():
        assert _selects(spec["selector"], _pod_labels(deployment))
    cluster_ip = {port["name"]: port for port in services["encoder"]["ports"]}
    assert cluster_ip["grpc"]["port"] == GRPC_PORT
    assert cluster_ip["grpc"]["targetPort"] == "grpc"
    assert cluster_ip["grpc"]["appProtocol"] == "grpc"
    assert cluster_ip["metrics"]["port"] == METRICS_PORT
    assert cluster_ip["metrics"]["targetPort"] == "metrics"
    headless = services["encoder-headless"]
    assert headless["clusterIP"] == "None"
    assert [(port["name"], port["port"], port["appProtocol"]) for port in headless["ports"]] == [
        ("grpc", GRPC_PORT, "grpc")
    ]


def test_service_monitor_scrapes_the_metrics_port(by_kind: dict[str, list[Manifest]], container: Manifest) -> None:
    (monitor,) = by_kind["ServiceMonitor"]
    spec = monitor["spec"]
    assert set(spec["selector"]) == {"matchLabels"}
    selected = [
        service
        for service in by_kind["Service"]
        if _selects(spec["selector"]["matchLabels"], service["metadata"]["labels"])
    ]
    # One Service only: selecting the headless one as well would scrape every pod twice.
    assert [service["metadata"]["name"] for service in selected] == ["encoder"]
    service_ports = {port["name"]: port for port in selected[0]["spec"]["ports"]}
    container_ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics"
    target = service_ports[endpoint["port"]]["targetPort"]
    assert container_ports[target] == METRICS_PORT


def test_autoscaler(variant: str, by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
    (autoscaler,) = by_kind["HorizontalPodAutoscaler"]
    spec = autoscaler["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    metrics = {metric["type"]: metric for metric in spec["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Resource"]["resource"]["target"]["type"] == "Utilization"
    # A metric the HPA cannot read blocks every scale-down: the custom one is opt-in.
    if variant.endswith("inflight-autoscaling"):
        assert metrics["Pods"]["pods"]["metric"]["name"] == "encoder_inflight_requests"
    else:
        assert set(metrics) == {"Resource"}


def test_disruption_budget(by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
    (budget,) = by_kind["PodDisruptionBudget"]
    (autoscaler,) = by_kind["HorizontalPodAutoscaler"]
    assert _selects(budget["spec"]["selector"]["matchLabels"], _pod_labels(deployment))
    assert budget["spec"]["maxUnavailable"] < autoscaler["spec"]["minReplicas"]


def test_network_policy(by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
    (policy,) = by_kind["NetworkPolicy"]
    spec = policy["spec"]
    assert _selects(spec["podSelector"]["matchLabels"], _pod_labels(deployment))
    assert spec["policyTypes"] == ["Ingress"]
    sources_by_port: dict[int, list[Manifest]] = {}
    for rule in spec["ingress"]:
        for port in rule["ports"]:
            sources_by_port.setdefault(port["port"], []).extend(rule["from"])
    assert set(sources_by_port) == {GRPC_PORT, METRICS_PORT}
    assert sources_by_port[GRPC_PORT] == [{"namespaceSelector": {}}]
    assert sources_by_port[METRICS_PORT] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


def test_grafana_dashboard_config_map(by_kind: dict[str, list[Manifest]]) -> None:
    (config_map,) = by_kind["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["encoder-dashboard.json"])
    assert shipped == json.loads((REPO_ROOT / "deploy" / "grafana" / "encoder-dashboard.json").read_text())


def test_overlays_keep_every_base_object(renders: dict[str, list[Manifest]]) -> None:
    names = {
        variant: {(item["kind"], item["metadata"]["name"]) for item in objects} for variant, objects in renders.items()
    }
    for variant_names in names.values():
        assert names["base"] <= variant_names
