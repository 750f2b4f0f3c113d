"""The rendered Kubernetes objects: schemas, and agreement with the server's contract and the image."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from service.ops.settings import ENV_PREFIX, Settings, load_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
HEALTH_PORT = 8003  # the plaintext grpc.health.v1 listener the kubelet probes
DEFAULT_DRAIN_TIMEOUT_S = 30
NAMESPACE = "encoder"
# Custom resources: kubernetes-validate has no schema for them (their operators' CRDs define it).
CUSTOM_RESOURCE_APIS = {"monitoring.coreos.com/v1", "cert-manager.io/v1"}

# The server's settings as environment variables, from the server's own settings object.
SERVER_SETTINGS = {ENV_PREFIX + item.name.upper() for item in dataclasses.fields(Settings)}

# What a Secret of type kubernetes.io/tls holds, with ca.crt as cert-manager adds it.
TLS_SECRET_KEYS = ("tls.crt", "tls.key", "ca.crt")

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


def test_variant_objects(manifests: list[Manifest], components: set[str]) -> None:
    kinds = sorted(item["kind"] for item in manifests)
    # Keys and certificates are never part of the repository: Secrets come from the cluster.
    assert "Secret" not in kinds
    assert ("Certificate" in kinds) == ("cert-manager" in components)
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


@functools.cache
def _schema_error(version: str, document: str) -> str | None:
    """Why one object (as JSON) breaks its schema, or None. Cached: the variants share most objects."""
    item = json.loads(document)
    # Strict: unknown (misspelt) fields are errors too. SchemaNotFoundError fails the test.
    try:
        kubernetes_validate.validate(item, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(part) for part in error.path)
        return f"{item['kind']}/{item['metadata']['name']} at {path}: {error.message}"
    return None


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_objects_match_kubernetes_schemas(manifests: list[Manifest], version: str) -> None:
    core = [item for item in manifests if item["apiVersion"] not in CUSTOM_RESOURCE_APIS]
    assert len(core) >= 9
    for item in core:
        error = _schema_error(version, json.dumps(item, sort_keys=True))
        assert error is None, error


def test_schema_validation_catches_a_misspelt_field(renders: dict[str, list[Manifest]]) -> None:
    """The validation above can fail: a typo in a probe is rejected."""
    (deployment,) = [item for item in renders["base"] if item["kind"] == "Deployment"]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": GRPC_PORT}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[0], strict=True)


def test_container_ports_are_the_server_defaults(container: Manifest) -> None:
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT, "health": HEALTH_PORT}
    # The defaults are used: an override here would have to move every port below with it.
    assert not {"ENCODER_HTTP_PORT", "ENCODER_GRPC_PORT", "ENCODER_METRICS_PORT"} & set(_env(container))


def test_settings_are_known_to_the_server(container: Manifest) -> None:
    assert set(_env(container)) <= SERVER_SETTINGS


def _secret_files(deployment: Manifest, container: Manifest) -> dict[str, str]:
    """Path in the container -> Secret key, for every file that a mounted Secret volume provides."""
    volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        # Projected items, or the whole Secret (only the TLS one is mounted whole).
        items = secret.get("items") or [{"key": key, "path": key} for key in TLS_SECRET_KEYS]
        for item in items:
            files[f"{mount['mountPath']}/{item['path']}"] = item["key"]
    return files


def test_server_accepts_the_settings(
    deployment: Manifest, container: Manifest, components: set[str], tls: bool, tmp_path: Path
) -> None:
    """The server's own settings loader takes the pod's environment, and listens where the pod expects."""
    secret_files = _secret_files(deployment, container)
    environ = {}
    for name, item in _env(container).items():
        if "valueFrom" in item:
            # The kubelet gives limits.cpu with divisor 1 as whole CPUs, rounded up.
            environ[name] = str(math.ceil(_cpu_cores(container["resources"]["limits"]["cpu"])))
        elif item["value"] in secret_files:
            # The settings check that the file is there: stand in for the Secret's file.
            stand_in = tmp_path / item["value"].lstrip("/")
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.write_text(f"stands in for the Secret's key {secret_files[item['value']]}\n")
            environ[name] = str(stand_in)
        else:
            environ[name] = item["value"]
    settings = load_settings([], environ)
    assert (settings.http_port, settings.grpc_port, settings.metrics_port) == (HTTP_PORT, GRPC_PORT, METRICS_PORT)
    assert settings.drain_timeout_s == _drain_timeout_s(container)
    assert bool(settings.tls_cert) == bool(settings.tls_key) == tls
    assert bool(settings.tls_client_ca) == ("mtls" in components)
    assert bool(settings.api_key_file) == ("api-key" in components)
    # The kubelet's probes go to the server's plaintext health port, with or without TLS on the others.
    assert settings.health_port == HEALTH_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == settings.health_port, probe


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_native_grpc_probes(container: Manifest, probe: str) -> None:
    spec = container[probe]
    assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
    # The plaintext health listener: no TLS to speak, and no queue of inference calls to wait behind.
    assert spec["grpc"]["port"] == HEALTH_PORT
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
    # Mounted Secrets are group-readable only (0440): the group must be the server's.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
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
    instances = int(env.get("ENCODER_INSTANCES", {"value": "1"})["value"])
    frontends = int(env.get("ENCODER_FRONTENDS", {"value": "1"})["value"])
    # One process: the model's threads take the limit. Several: the front ends take one CPU each.
    assert instances * thread_count + (frontends if frontends > 1 else 0) == cpu_limit


def test_device_and_image_per_variant(overlay: str, deployment: Manifest, container: Manifest) -> None:
    env = _env(container)
    limits = container["resources"]["limits"]
    if overlay == "gpu":
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
    if overlay == "cpu":
        assert env["ENCODER_DEVICE"]["value"] == "cpu"
        assert container["image"].endswith("-cpu")


# What each CUDA major of the image's base needs of the node: the lowest GPU compute capability
# (CUDA 13 dropped Maxwell 5.x, Pascal 6.x and Volta 7.0/7.2) and the lowest driver branch.
CUDA_NEEDS = {13: {"compute_capability": (7, 5), "driver_major": 580}}
# GPU Feature Discovery's labels of some nodes: (compute capability, driver major, architecture).
GPU_NODES = {
    "M60": ((5, 2), 580, "amd64"),
    "P100": ((6, 0), 580, "amd64"),
    "V100": ((7, 0), 580, "amd64"),
    "T4": ((7, 5), 580, "amd64"),
    "A100": ((8, 0), 580, "amd64"),
    "A100 on driver 570": ((8, 0), 570, "amd64"),
    "L4": ((8, 9), 590, "amd64"),
    "H100": ((9, 0), 580, "amd64"),
    "GH200 (arm64)": ((9, 0), 580, "arm64"),
    "B200": ((10, 0), 580, "amd64"),
    "RTX 5090": ((12, 0), 580, "amd64"),
}


def _image_cuda_major() -> int:
    """The CUDA major of the Dockerfile's default runtime base (nvidia/cuda:MAJOR.MINOR.PATCH-...)."""
    match = re.search(r"^ARG BASE=nvidia/cuda:(\d+)\.", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "the Dockerfile's default BASE is not an nvidia/cuda image"
    return int(match.group(1))


def _matches(expression: Manifest, labels: dict[str, str]) -> bool:
    """One node selector requirement, as the scheduler evaluates it."""
    value, operator, values = labels.get(expression["key"]), expression["operator"], expression.get("values", [])
    if operator in ("Exists", "DoesNotExist"):
        return (value is not None) == (operator == "Exists")
    if operator in ("In", "NotIn"):
        return (value in values) == (operator == "In")
    (bound,) = values
    if value is None or not value.isdigit():
        return False
    return int(value) > int(bound) if operator == "Gt" else int(value) < int(bound)


def _schedulable(deployment: Manifest, labels: dict[str, str]) -> bool:
    """Whether the pod's required node affinity admits a node with these labels."""
    affinity = deployment["spec"]["template"]["spec"].get("affinity", {}).get("nodeAffinity", {})
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(
        all(_matches(expression, labels) for expression in term.get("matchExpressions", []))
        for term in required["nodeSelectorTerms"]
    )


def test_gpu_pods_only_on_gpus_the_image_supports(overlay: str, deployment: Manifest) -> None:
    needs = CUDA_NEEDS[_image_cuda_major()]
    wrong = []
    for node, ((major, minor), driver_major, architecture) in GPU_NODES.items():
        labels = {
            "kubernetes.io/arch": architecture,
            "nvidia.com/gpu.compute.major": str(major),
            "nvidia.com/gpu.compute.minor": str(minor),
            "nvidia.com/cuda.driver-version.major": str(driver_major),
        }
        supported = (
            (major, minor) >= needs["compute_capability"]
            and driver_major >= needs["driver_major"]
            and architecture == "amd64"  # onnxruntime-gpu is installed on x86_64 only (pyproject)
        )
        if overlay == "gpu" and _schedulable(deployment, labels) != supported:
            wrong.append(f"{node}: {'refused' if supported else 'admitted'}")
    assert not wrong, wrong
    # Without GPU Feature Discovery's labels no GPU pod is placed; CPU pods go anywhere.
    assert _schedulable(deployment, {"kubernetes.io/arch": "amd64"}) == (overlay != "gpu")


def test_services(by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
    services = {service["metadata"]["name"]: service["spec"] for service in by_kind["Service"]}
    assert set(services) == {"encoder", "encoder-headless"}
    for spec in services.values():
        assert _selects(spec["selector"], _pod_labels(deployment))
    cluster_ip = {port["name"]: port for port in services["encoder"]["ports"]}
    # Never the plaintext health port: only the kubelet needs it.
    assert set(cluster_ip) == {"http", "grpc", "metrics"}
    assert (cluster_ip["http"]["port"], cluster_ip["http"]["targetPort"]) == (HTTP_PORT, "http")
    assert cluster_ip["http"]["appProtocol"] == "http"
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


def test_autoscaler(components: set[str], by_kind: dict[str, list[Manifest]], deployment: Manifest) -> None:
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
    if "inflight-autoscaling" in components:
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
    # The health port is not opened to any pod: the kubelet reaches it from the node.
    assert set(sources_by_port) == {HTTP_PORT, GRPC_PORT, METRICS_PORT}
    assert sources_by_port[HTTP_PORT] == sources_by_port[GRPC_PORT] == [{"namespaceSelector": {}}]
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


MEMORY_BUDGET_GIB = 1.0
"""The server's RSS budget with the default model on the CPU (docs/operations.md, "Memory budget": peak 0.64 GiB)."""


def _gibibytes(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_the_memory_limit_holds_the_budget_twice(container: Manifest) -> None:
    assert _gibibytes(container["resources"]["limits"]["memory"]) >= 2 * MEMORY_BUDGET_GIB
