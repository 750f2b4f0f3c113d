"""deploy/kserve: the ServingRuntime and InferenceServices against KServe's API, and against the server.

No cluster here: the objects are checked against a schema written from KServe's CRD types
(kserve/kserve pkg/apis/serving: v1alpha1 ServingRuntimeSpec, v1beta1 InferenceServiceSpec,
PredictorSpec, ModelSpec, ComponentExtensionSpec), and the pod KServe would make of them (its
merge of the InferenceService's model into the runtime's container) against Kubernetes' own schema.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.ops import settings as server_settings
from service.ops.settings import SettingsError, load_settings
from tests.deploy.conftest import DEPLOY, _kubectl, _kustomize
from tests.deploy.test_manifests import (
    DEFAULT_DRAIN_TIMEOUT_S,
    GRPC_PORT,
    HEALTH_PORT,
    HTTP_PORT,
    METRICS_PORT,
    SCHEMA_VERSIONS,
    SERVER_SETTINGS,
)

Manifest = dict[str, Any]

KSERVE = DEPLOY / "kserve"
RUNTIME = "encoder-serve"
# The example InferenceServices, by their kustomization (deploy/kserve/<example>): on CPUs from an exported
# repository (the default, deploy/kserve itself), on a GPU, and on CPUs from a raw model folder exported in the pod.
INFERENCE_SERVICES = {
    "cpu": "all-minilm-l6-v2-cpu",
    "gpu": "all-minilm-l6-v2-gpu",
    "from-folder": "all-minilm-l6-v2-from-folder",
}
EXAMPLE_DEVICES = {"cpu": "cpu", "gpu": "gpu", "from-folder": "cpu"}
"""The device each example serves on (the overlay of the plain Deployment it matches)."""
EXPORT_CACHE = "/var/cache/encoder-serve"
HUGGING_FACE_ENVIRONMENT = {"HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"}
"""huggingface_hub's variables, which the exporter a model served by name runs reads (docs/operations.md)."""
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

# --- KServe's facts (kserve/kserve pkg/constants/constants.go unless said otherwise) ---
# InferenceServiceContainerName: the runtime container KServe merges the model spec into.
KSERVE_CONTAINER = "kserve-container"
# DefaultModelLocalMountPath: where the storage initializer's download (storageUri) is mounted.
MODEL_MOUNT_PATH = "/mnt/models"
# pkg/webhook/admission/pod: StorageInitializerVolumeName, the emptyDir behind that mount.
STORAGE_VOLUME = "kserve-provision-location"
# InferenceServiceProtocol values.
PROTOCOL_VERSIONS = ("v1", "v2", "grpc-v1", "grpc-v2")
# ModelSpec.GetProtocol(): a model without protocolVersion asks for v1.
DEFAULT_PROTOCOL = "v1"
# SupportedStorageURIPrefixList (pkg/controller/v1beta1/inferenceservice/utils).
STORAGE_URI_PREFIXES = (
    "gs://", "s3://", "pvc://", "file://", "https://", "http://", "hdfs://", "webhdfs://", "oci://", "hf://",
)  # fmt: skip
# IsvcNameFmt (v1beta1 inference_service_validation.go).
INFERENCE_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# serving.kserve.io/deploymentMode: "RawDeployment" selects a plain Deployment in every release (newer
# ones call it Standard and read the old name as that). Knative's mode refuses a container `lifecycle`.
DEPLOYMENT_MODE = ("serving.kserve.io/deploymentMode", "RawDeployment")

# --- The CRDs' structure, KServe's own fields. Kubernetes types inside them (Container, Volume,
# Affinity, PodSpec fields, ...) are checked against Kubernetes' schema in the pod built below. ---
_STRING = {"type": "string"}
_BOOLEAN = {"type": "boolean"}
_COUNT = {"type": "integer", "minimum": 0}
_STRING_MAP = {"type": "object", "additionalProperties": _STRING}
_OBJECT = {"type": "object"}  # a Kubernetes type, or a KServe feature these manifests do not use
_OBJECTS = {"type": "array", "items": _OBJECT}
_PROTOCOL = {"enum": list(PROTOCOL_VERSIONS)}


def _struct(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A Go struct: these fields only (a misspelt one is an error), some of them required."""
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


# v1alpha1.SupportedModelFormat (priority: +kubebuilder:validation:Minimum=1).
SUPPORTED_MODEL_FORMAT = _struct(
    {"name": _STRING, "version": _STRING, "autoSelect": _BOOLEAN, "priority": {"type": "integer", "minimum": 1}},
    required=("name",),
)
# v1alpha1.ServingRuntimePodSpec: what of a pod a runtime may hold (containers: validate:"required").
SERVING_RUNTIME_POD_SPEC = {
    "containers": {"type": "array", "minItems": 1, "items": _OBJECT},
    "volumes": _OBJECTS,
    "nodeSelector": _STRING_MAP,
    "affinity": _OBJECT,
    "tolerations": _OBJECTS,
    "labels": _STRING_MAP,
    "annotations": _STRING_MAP,
    "imagePullSecrets": _OBJECTS,
    "hostIPC": _BOOLEAN,
}
# v1alpha1.ServingRuntimeSpec (the CRD requires containers; the ModelMesh fields are not used here).
SERVING_RUNTIME_SPEC = _struct(
    {
        "supportedModelFormats": {"type": "array", "items": SUPPORTED_MODEL_FORMAT},
        "multiModel": _BOOLEAN,
        "disabled": _BOOLEAN,
        "protocolVersions": {"type": "array", "items": _PROTOCOL},
        "workerSpec": _OBJECT,
        **SERVING_RUNTIME_POD_SPEC,
        "grpcEndpoint": _STRING,
        "grpcDataEndpoint": _STRING,
        "httpDataEndpoint": _STRING,
        "replicas": _COUNT,
        "storageHelper": _struct({"disabled": _BOOLEAN}),
        "builtInAdapter": _OBJECT,
    },
    required=("containers",),
)
# v1beta1.ModelSpec: its own fields and PredictorExtensionSpec's; the rest is an inline corev1.Container.
MODEL_SPEC_FIELDS = {
    "modelFormat": _struct({"name": _STRING, "version": _STRING}, required=("name",)),
    "runtime": _STRING,
    "storageUri": _STRING,
    "runtimeVersion": _STRING,
    "protocolVersion": _PROTOCOL,
    "storage": _OBJECT,
}
# v1beta1.ComponentExtensionSpec (scaleMetric, scaleMetricType: kubebuilder enums).
COMPONENT_EXTENSION_FIELDS = {
    "minReplicas": _COUNT,
    "maxReplicas": _COUNT,
    "scaleTarget": {"type": "integer"},
    "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
    "scaleMetricType": {"enum": ["Utilization", "Value", "AverageValue"]},
    "autoScaling": _OBJECT,
    "containerConcurrency": _COUNT,
    "timeout": {"type": "integer"},
    "canaryTrafficPercent": {"type": "integer", "minimum": 0, "maximum": 100},
    "logger": _OBJECT,
    "batcher": _OBJECT,
    "labels": _STRING_MAP,
    "annotations": _STRING_MAP,
    "deploymentStrategy": _OBJECT,
}
# v1beta1.PredictorSpec: the one-of implementations, model, storageUris, workerSpec and the component
# extension; the rest is an inline v1beta1.PodSpec (corev1.PodSpec's fields).
PREDICTOR_FIELDS = {
    **dict.fromkeys(
        ("sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml", "lightgbm", "paddle"),
        _OBJECT,
    ),
    "model": {"type": "object", "properties": MODEL_SPEC_FIELDS, "required": ["modelFormat"]},
    "storageUris": _OBJECTS,
    "workerSpec": _OBJECT,
    **COMPONENT_EXTENSION_FIELDS,
}
# v1beta1.InferenceServiceSpec: predictor is +required.
INFERENCE_SERVICE_SPEC = _struct(
    {"predictor": {"type": "object", "properties": PREDICTOR_FIELDS}, "explainer": _OBJECT, "transformer": _OBJECT},
    required=("predictor",),
)


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _struct(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"type": "object", "properties": {"name": _STRING}, "required": ["name"]},
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )


# The Prometheus Operator's monitoring.coreos.com/v1 PodMonitorSpec and PodMetricsEndpoint (the fields used, and
# their neighbours; required as its CRD requires them).
POD_METRICS_ENDPOINT = _struct(
    {
        "port": _STRING,
        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
        "targetPort": {"type": ["integer", "string"]},
        "path": _STRING,
        "scheme": {"enum": ["http", "https"]},
        "interval": _STRING,
        "scrapeTimeout": _STRING,
        "honorLabels": _BOOLEAN,
        "relabelings": _OBJECTS,
        "metricRelabelings": _OBJECTS,
    }
)
POD_MONITOR_SPEC = _struct(
    {
        "selector": _OBJECT,
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": POD_METRICS_ENDPOINT},
        "namespaceSelector": _OBJECT,
        "jobLabel": _STRING,
        "podTargetLabels": {"type": "array", "items": _STRING},
        "sampleLimit": _COUNT,
    },
    required=("selector", "podMetricsEndpoints"),
)
SCHEMAS = {
    "ServingRuntime": _resource("serving.kserve.io/v1alpha1", "ServingRuntime", SERVING_RUNTIME_SPEC),
    "InferenceService": _resource("serving.kserve.io/v1beta1", "InferenceService", INFERENCE_SERVICE_SPEC),
    "PodMonitor": _resource("monitoring.coreos.com/v1", "PodMonitor", POD_MONITOR_SPEC),
}

# --- The pod KServe makes (Standard mode): what of the runtime's pod fields MergePodSpec keeps, and
# the patchMergeKey of the lists its strategic merge patches merge item by item (others are replaced).
RUNTIME_POD_FIELDS = ("nodeSelector", "affinity", "tolerations", "volumes", "imagePullSecrets")
CONTAINER_MERGE_KEYS = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath"}
POD_MERGE_KEYS = {"volumes": "name", "imagePullSecrets": "name"}


def _merge(base: Any, patch: Any, list_keys: dict[str, str]) -> Any:
    """`patch` applied to `base` as a strategic merge patch: maps merged, keyed lists merged by key."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if key in list_keys and isinstance(merged.get(key), list):
            merge_key = list_keys[key]
            by_key = {item[merge_key]: item for item in merged[key]}
            for item in value:
                by_key[item[merge_key]] = _merge(by_key.get(item[merge_key], {}), item, {})
            merged[key] = list(by_key.values())
        else:
            merged[key] = _merge(merged.get(key), value, {})
    return merged


def _with_tag(image: str, tag: str) -> str:
    """The image with a runtimeVersion as its tag, as KServe's UpdateImageTag puts it (digests are kept)."""
    if "@sha256:" in image:
        return image
    name, colon, old_tag = image.rpartition(":")
    if colon and re.fullmatch(r"[\w.-]*", old_tag):
        return f"{name}:{tag}"
    return f"{image}:{tag}"


def _runtime_container(runtime: Manifest) -> Manifest:
    (found,) = [item for item in runtime["spec"]["containers"] if item.get("name") == KSERVE_CONTAINER]
    return found


def _effective_container(runtime: Manifest, model: Manifest) -> Manifest:
    """KServe's MergeRuntimeContainers, UpdateImageTag and storage mount for one model spec."""
    runtime_container = _runtime_container(runtime)
    overrides = {key: value for key, value in model.items() if key not in MODEL_SPEC_FIELDS}
    container = _merge(runtime_container, overrides, CONTAINER_MERGE_KEYS)
    container["name"] = KSERVE_CONTAINER
    # The InferenceService's args follow the runtime's; they do not replace them.
    args = [*runtime_container.get("args", []), *overrides.get("args", [])]
    if args:
        container["args"] = args
    if "runtimeVersion" in model:
        container["image"] = _with_tag(container["image"], model["runtimeVersion"])
    if "storageUri" in model:
        mount = {"name": STORAGE_VOLUME, "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
        container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
    return container


def _effective_pod(runtime: Manifest, inference_service: Manifest) -> Manifest:
    """The predictor pod KServe makes of a runtime and an InferenceService (before its init container)."""
    predictor = inference_service["spec"]["predictor"]
    runtime_spec = runtime["spec"]
    pod_spec = _merge(
        {key: runtime_spec[key] for key in RUNTIME_POD_FIELDS if key in runtime_spec},
        {key: value for key, value in predictor.items() if key not in PREDICTOR_FIELDS},
        POD_MERGE_KEYS,
    )
    others = [item for item in runtime_spec["containers"] if item.get("name") != KSERVE_CONTAINER]
    pod_spec["containers"] = [_effective_container(runtime, predictor["model"]), *others]
    if "storageUri" in predictor["model"]:
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), {"name": STORAGE_VOLUME, "emptyDir": {}}]
    metadata = {"name": f"{inference_service['metadata']['name']}-predictor"}
    for key in ("labels", "annotations"):
        if key in runtime_spec:
            metadata[key] = runtime_spec[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _runtime_pod(runtime: Manifest) -> Manifest:
    """The runtime's own pod fields as a pod, so that Kubernetes' schema checks its containers."""
    spec = runtime["spec"]
    fields = ("containers", *RUNTIME_POD_FIELDS, "hostIPC")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": runtime["metadata"]["name"]},
        "spec": {key: spec[key] for key in fields if key in spec},
    }


def _pod_errors(pod: Manifest) -> list[str]:
    """Why Kubernetes' schema (strict: unknown fields too) refuses the pod, at each version the manifests target."""
    errors = []
    for version in SCHEMA_VERSIONS:
        try:
            kubernetes_validate.validate(pod, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            errors.append(f"{pod['metadata']['name']} (Kubernetes {version}) at {path}: {error.message}")
    return errors


def _selection_errors(runtimes: dict[str, Manifest], inference_service: Manifest) -> list[str]:
    """Why KServe would not run the InferenceService's model on the runtime it names (ModelSpec.RuntimeSupportsModel,
    ServingRuntimeSpec.IsProtocolVersionSupported), or not accept its name or storage URI."""
    name = inference_service["metadata"]["name"]
    model = inference_service["spec"]["predictor"]["model"]
    errors = []
    if not INFERENCE_SERVICE_NAME.fullmatch(name):
        errors.append(f"{name}: not a valid InferenceService name")
    if not model.get("storageUri", "").startswith(STORAGE_URI_PREFIXES):
        errors.append(f"{name}: storageUri {model.get('storageUri')!r} is not one KServe's storage initializer fetches")
    runtime = runtimes.get(model.get("runtime", ""))
    if runtime is None:
        return [*errors, f"{name}: no ServingRuntime named {model.get('runtime')!r}"]
    spec = runtime["spec"]
    # With the runtime named, each supported format counts by name, and by name and version.
    labels = {(entry["name"], entry.get("version")) for entry in spec.get("supportedModelFormats", [])}
    labels |= {(entry_name, None) for entry_name, _ in labels}
    model_format = model["modelFormat"]
    if (model_format["name"], model_format.get("version")) not in labels or spec.get("disabled", False):
        errors.append(f"{name}: runtime {model['runtime']} does not serve {model_format}")
    protocol = model.get("protocolVersion", DEFAULT_PROTOCOL)
    if spec.get("protocolVersions") and protocol not in spec["protocolVersions"]:
        errors.append(f"{name}: runtime {model['runtime']} does not speak {protocol}")
    return errors


def _kserve_errors(objects: list[Manifest]) -> list[str]:
    """Why KServe would refuse the objects or fail to run them: each against its CRD's structure, the pods
    made of them against Kubernetes' schema, and each InferenceService against the runtime it names."""
    errors = []
    for item in objects:
        schema = SCHEMAS.get(item.get("kind"))
        if schema is None:
            errors.append(f"{item.get('kind')}: not a kind this check knows")
            continue
        for error in jsonschema.Draft202012Validator(schema).iter_errors(item):
            path = ".".join(str(part) for part in error.absolute_path)
            errors.append(f"{item['kind']}/{item.get('metadata', {}).get('name')} at {path}: {error.message}")
    if errors:
        return errors  # no pods to build from objects of the wrong shape
    runtimes = {item["metadata"]["name"]: item for item in objects if item["kind"] == "ServingRuntime"}
    for runtime in runtimes.values():
        errors += _pod_errors(_runtime_pod(runtime))
    for item in objects:
        if item["kind"] != "InferenceService":
            continue
        errors += _selection_errors(runtimes, item)
        runtime = runtimes.get(item["spec"]["predictor"]["model"].get("runtime", ""))
        if runtime is not None:
            errors += _pod_errors(_effective_pod(runtime, item))
    return errors


def _server_errors(pod: Manifest) -> list[str]:
    """Where the server container disagrees with the server: settings it does not have or refuses, a model
    repository other than KServe's mount, ports and probes other than the server's."""
    (container,) = [item for item in pod["spec"]["containers"] if item["name"] == KSERVE_CONTAINER]
    env = {item["name"]: item for item in container.get("env", [])}
    known = SERVER_SETTINGS | HUGGING_FACE_ENVIRONMENT
    errors = [f"{name} is not a server setting" for name in sorted(set(env) - known)]
    errors += [
        f"{name} has both value and valueFrom" for name, item in env.items() if {"value", "valueFrom"} <= set(item)
    ]
    environ = {name: item["value"] for name, item in env.items() if "value" in item}
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal):  # argparse writes its refusal there, and exits
            settings = load_settings(container.get("args", []), environ)
    except (SettingsError, SystemExit) as error:
        reason = refusal.getvalue().strip().splitlines()[-1] if refusal.getvalue().strip() else str(error)
        return [*errors, f"the server refuses its settings: {reason}"]
    if settings.model_repository != Path(MODEL_MOUNT_PATH):
        errors.append(f"serves {settings.model_repository}, not KServe's model mount {MODEL_MOUNT_PATH}")
    if MODEL_MOUNT_PATH not in {mount["mountPath"] for mount in container.get("volumeMounts", [])}:
        errors.append(f"nothing is mounted at {MODEL_MOUNT_PATH} (no storageUri)")
    listening = (settings.http_port, settings.grpc_port, settings.metrics_port, settings.health_port)
    if listening != (HTTP_PORT, GRPC_PORT, METRICS_PORT, HEALTH_PORT):
        errors.append(f"listens on {listening}, not the ports the manifests use")
    declared = [port["containerPort"] for port in container.get("ports", [])]
    if declared != [settings.http_port]:
        errors.append(f"declares ports {declared}: KServe routes to one, here the HTTP port {settings.http_port}")
    for probe in PROBES:
        port = container.get(probe, {}).get("grpc", {}).get("port")
        if port != settings.health_port:
            errors.append(f"{probe} probes gRPC port {port}, not the health port {settings.health_port}")
    return errors


@pytest.fixture(scope="module")
def renders() -> dict[str, list[Manifest]]:
    """deploy/kserve (the CPU example) and each other example's kustomization, rendered with `kubectl kustomize`."""
    kubectl = _kubectl()
    return {
        example: _kustomize(kubectl, KSERVE / ("" if example == "cpu" else example)) for example in INFERENCE_SERVICES
    }


@pytest.fixture(scope="module")
def objects(renders: dict[str, list[Manifest]]) -> list[Manifest]:
    """The runtime, its PodMonitor and every example InferenceService (each kustomization's, once)."""
    found = {(item["kind"], item["metadata"]["name"]): item for render in renders.values() for item in render}
    return list(found.values())


@pytest.fixture(scope="module")
def runtime(objects: list[Manifest]) -> Manifest:
    """The ServingRuntime."""
    (found,) = [item for item in objects if item["kind"] == "ServingRuntime"]
    return found


@pytest.fixture(params=sorted(INFERENCE_SERVICES))
def device(request: pytest.FixtureRequest) -> str:
    """cpu or gpu: which example InferenceService."""
    return request.param


@pytest.fixture
def inference_service(objects: list[Manifest], device: str) -> Manifest:
    """The example InferenceService for the device."""
    (found,) = [item for item in objects if item["metadata"]["name"] == INFERENCE_SERVICES[device]]
    return found


@pytest.fixture
def pod(runtime: Manifest, inference_service: Manifest) -> Manifest:
    """The predictor pod KServe would make for the InferenceService."""
    return _effective_pod(runtime, inference_service)


@pytest.fixture
def container(pod: Manifest) -> Manifest:
    """The server container of that pod."""
    (found,) = [item for item in pod["spec"]["containers"] if item["name"] == KSERVE_CONTAINER]
    return found


def _base_deployment() -> Manifest:
    return yaml.safe_load((DEPLOY / "base" / "deployment.yaml").read_text())


def _overlay_image(overlay: str) -> str:
    """The image an overlay of the plain Deployment names (its kustomization's `images:`)."""
    kustomization = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    return f"{image['newName']}:{image['newTag']}"


def test_objects(objects: list[Manifest], renders: dict[str, list[Manifest]]) -> None:
    kinds = sorted((item["kind"], item["metadata"]["name"]) for item in objects)
    assert kinds == [
        *sorted(("InferenceService", name) for name in INFERENCE_SERVICES.values()),
        ("PodMonitor", RUNTIME),
        ("ServingRuntime", RUNTIME),
    ]
    # Each kustomization applies the runtime, its PodMonitor and one InferenceService: its own example.
    for example, render in renders.items():
        services = [item["metadata"]["name"] for item in render if item["kind"] == "InferenceService"]
        assert services == [INFERENCE_SERVICES[example]], example
        assert sorted(item["kind"] for item in render) == ["InferenceService", "PodMonitor", "ServingRuntime"]
    # No namespace: `kubectl apply -n <namespace> -k` puts them where the user says, together, as an
    # InferenceService finds a ServingRuntime only in its own namespace.
    assert all("namespace" not in item["metadata"] for item in objects)


def test_objects_match_kserve_api(objects: list[Manifest]) -> None:
    assert _kserve_errors(objects) == []


def _rename(mapping: Manifest, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _runtime_spec(objects: list[Manifest]) -> Manifest:
    (found,) = [item for item in objects if item["kind"] == "ServingRuntime"]
    return found["spec"]


def _cpu_model(objects: list[Manifest]) -> Manifest:
    return _cpu_predictor(objects)["model"]


def _cpu_predictor(objects: list[Manifest]) -> Manifest:
    (found,) = [item for item in objects if item["metadata"]["name"] == INFERENCE_SERVICES["cpu"]]
    return found["spec"]["predictor"]


# Deliberately broken copies, each with (part of) the reason it must be refused for.
BREAKAGES: dict[str, tuple[Callable[[list[Manifest]], object], str]] = {
    "misspelt runtime field": (
        lambda objects: _rename(_runtime_spec(objects), "protocolVersions", "protocolVersion"),
        "'protocolVersion' was unexpected",
    ),
    "unknown runtime protocol": (
        lambda objects: _runtime_spec(objects)["protocolVersions"].append("grpc"),
        "'grpc' is not one of",
    ),
    "runtime without containers": (
        lambda objects: _runtime_spec(objects).pop("containers"),
        "'containers' is a required property",
    ),
    "misspelt container field": (
        lambda objects: _rename(_runtime_spec(objects)["containers"][0], "readinessProbe", "readinesProbe"),
        "'readinesProbe' was unexpected",
    ),
    "misspelt model field": (
        lambda objects: _rename(_cpu_model(objects), "storageUri", "storageURI"),
        "'storageURI' was unexpected",
    ),
    "misspelt container field in the model": (
        lambda objects: _rename(_cpu_model(objects), "env", "envs"),
        "'envs' was unexpected",
    ),
    "unknown model protocol": (
        lambda objects: _cpu_model(objects).update(protocolVersion="v3"),
        "'v3' is not one of",
    ),
    "protocol left to the v1 default": (
        lambda objects: _cpu_model(objects).pop("protocolVersion"),
        "does not speak v1",
    ),
    "model format version as a number": (
        lambda objects: _cpu_model(objects)["modelFormat"].update(version=1),
        "1 is not of type 'string'",
    ),
    "model format the runtime does not serve": (
        lambda objects: _cpu_model(objects)["modelFormat"].update(version="2"),
        "does not serve",
    ),
    "model without modelFormat": (
        lambda objects: _cpu_model(objects).pop("modelFormat"),
        "'modelFormat' is a required property",
    ),
    "misspelt runtime name": (
        lambda objects: _cpu_model(objects).update(runtime="encoder-srve"),
        "no ServingRuntime named 'encoder-srve'",
    ),
    "misspelt component field": (
        lambda objects: _rename(_cpu_predictor(objects), "minReplicas", "minReplica"),
        "'minReplica' was unexpected",
    ),
    "misspelt pod field": (
        lambda objects: _rename(_cpu_predictor(objects), "enableServiceLinks", "enableServiceLink"),
        "'enableServiceLink' was unexpected",
    ),
    "gRPC asked of the HTTP port": (
        lambda objects: _cpu_model(objects).update(protocolVersion="grpc-v2"),
        "does not speak grpc-v2",
    ),
    "storage the initializer cannot fetch": (
        lambda objects: _cpu_model(objects).update(storageUri="ftp://example/model_repository"),
        "storageUri 'ftp://example/model_repository' is not one",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_check_refuses_a_broken_copy(objects: list[Manifest], breakage: str) -> None:
    """The check above can fail: each deliberately broken copy is refused, for its own reason."""
    broken = copy.deepcopy(objects)
    breaking, reason = BREAKAGES[breakage]
    breaking(broken)
    errors = _kserve_errors(broken)
    assert any(reason in error for error in errors), errors


def test_server_contract(pod: Manifest) -> None:
    """The server takes the pod's settings, serves KServe's model mount, listens where KServe and the probes look."""
    assert _server_errors(pod) == []


def _env_entry(container: Manifest, name: str) -> Manifest:
    return next(item for item in container["env"] if item["name"] == name)


SERVER_BREAKAGES: dict[str, tuple[Callable[[Manifest], object], str]] = {
    "misspelt setting": (
        lambda container: _env_entry(container, "ENCODER_HEALTH_PORT").update(name="ENCODER_HELTH_PORT"),
        "ENCODER_HELTH_PORT is not a server setting",
    ),
    "value and valueFrom": (
        lambda container: _env_entry(container, "ENCODER_INSTANCES").update(
            valueFrom={"resourceFieldRef": {"resource": "limits.cpu"}}
        ),
        "ENCODER_INSTANCES has both value and valueFrom",
    ),
    "unknown flag": (
        lambda container: container["args"].extend(["--repository", "/mnt/models"]),
        "unrecognized arguments: --repository",
    ),
    "model repository elsewhere": (
        lambda container: container["args"].extend(["--model-repository", "/models"]),
        "serves /models, not KServe's model mount",
    ),
    "nothing mounted at the model path": (
        lambda container: container.update(
            volumeMounts=[mount for mount in container["volumeMounts"] if mount["mountPath"] != MODEL_MOUNT_PATH]
        ),
        f"nothing is mounted at {MODEL_MOUNT_PATH}",
    ),
    "a port moved": (
        lambda container: container["env"].append({"name": "ENCODER_HTTP_PORT", "value": "8080"}),
        "listens on (8080, ",
    ),
    "gRPC port declared": (
        lambda container: container.update(ports=[{"name": "h2c", "containerPort": GRPC_PORT}]),
        f"declares ports [{GRPC_PORT}]",
    ),
    "probe on the gRPC port": (
        lambda container: container["readinessProbe"]["grpc"].update(port=GRPC_PORT),
        f"readinessProbe probes gRPC port {GRPC_PORT}",
    ),
}


@pytest.mark.parametrize("breakage", sorted(SERVER_BREAKAGES))
def test_server_check_refuses_a_broken_copy(runtime: Manifest, objects: list[Manifest], breakage: str) -> None:
    """The server check can fail: each deliberately broken copy of the CPU pod is refused, for its own reason."""
    (cpu,) = [item for item in objects if item["metadata"]["name"] == INFERENCE_SERVICES["cpu"]]
    broken = _effective_pod(runtime, cpu)
    breaking, reason = SERVER_BREAKAGES[breakage]
    breaking(broken["spec"]["containers"][0])
    errors = _server_errors(broken)
    assert any(reason in error for error in errors), errors


def test_runtime_is_chosen_by_name_only(runtime: Manifest) -> None:
    """Not autoSelect: KServe must not hand this runtime an arbitrary ONNX model (it serves exported repositories)."""
    formats = runtime["spec"]["supportedModelFormats"]
    assert {entry["name"] for entry in formats} == {"onnx"}
    assert not any(entry.get("autoSelect", False) for entry in formats)
    # v2 only: KServe routes to the one declared port, HTTP 8000, so a grpc-v2 InferenceService must be refused.
    assert runtime["spec"]["protocolVersions"] == ["v2"]


def test_metrics_are_scraped_by_a_pod_monitor(objects: list[Manifest], runtime: Manifest) -> None:
    """KServe's prometheus.kserve.io annotations make nothing scrape in Standard mode: a PodMonitor does."""
    assert not any(key.startswith("prometheus.kserve.io/") for key in runtime["spec"].get("annotations", {}))
    (monitor,) = [item for item in objects if item["kind"] == "PodMonitor"]
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= runtime["spec"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["targetPort"], endpoint["path"]) == (METRICS_PORT, "/metrics")


def test_a_raw_folder_is_exported_into_the_cache_volume(objects: list[Manifest], runtime: Manifest) -> None:
    """The from-folder example serves /mnt/models by name: exported at start into the runtime's cache volume."""
    (service,) = [item for item in objects if item["metadata"]["name"] == INFERENCE_SERVICES["from-folder"]]
    pod = _effective_pod(runtime, service)
    (container,) = [item for item in pod["spec"]["containers"] if item["name"] == KSERVE_CONTAINER]
    environ = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    settings = load_settings(container["args"], environ)
    assert [text.split("=", 1)[1] for text in settings.model] == [MODEL_MOUNT_PATH]
    assert settings.export_cache == EXPORT_CACHE
    (mount,) = [item for item in container["volumeMounts"] if item["mountPath"] == EXPORT_CACHE]
    assert not mount.get("readOnly", False)
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes[mount["name"]]
    assert service["spec"]["predictor"]["model"]["storageUri"].startswith("hf://")


def test_standard_deployment_mode(inference_service: Manifest) -> None:
    key, value = DEPLOYMENT_MODE
    assert inference_service["metadata"]["annotations"][key] == value


def test_probes_and_shutdown(pod: Manifest, container: Manifest) -> None:
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # an export at start (docs/kserve.md)
    for probe in PROBES:
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
        assert container[probe]["grpc"].get("service", "") == ""
    assert set(container["lifecycle"]["preStop"]) == {"sleep"}
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = next((item for item in container["env"] if item["name"] == "ENCODER_DRAIN_TIMEOUT_S"), None)
    drain_s = int(drain["value"]) if drain else DEFAULT_DRAIN_TIMEOUT_S
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    liveness = container["livenessProbe"]
    # NOT_SERVING while draining must not get the container restarted.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop_s + drain_s


def test_security_as_in_the_base_deployment(pod: Manifest, container: Manifest) -> None:
    base_pod = _base_deployment()["spec"]["template"]["spec"]
    (base_container,) = base_pod["containers"]
    # fsGroup is for the Secrets the TLS and API key components mount; nothing here mounts one.
    expected_pod = {key: value for key, value in base_pod["securityContext"].items() if key != "fsGroup"}
    assert pod["spec"]["securityContext"] == expected_pod
    # A ServingRuntime has no pod securityContext: its container carries the same user and profile.
    for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert container["securityContext"][key] == base_pod["securityContext"][key], key
    for key, value in base_container["securityContext"].items():
        assert container["securityContext"][key] == value, key
    for key in ("automountServiceAccountToken", "enableServiceLinks"):
        assert pod["spec"][key] is False, key
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    (tmp,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]
    # KServe mounts the model read-only; the server never writes to its repository.
    (models,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == MODEL_MOUNT_PATH]
    assert models["readOnly"] is True


def _cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_resources_and_threads(container: Manifest, monkeypatch: pytest.MonkeyPatch) -> None:
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    for resource in ("cpu", "memory"):
        assert requests[resource] == limits[resource], f"{resource}: requests != limits (not Guaranteed QoS)"
    cpu_limit = _cpu_cores(limits["cpu"])
    assert cpu_limit == int(cpu_limit), "a fractional CPU limit throttles a thread pool of whole threads"
    environ = {item["name"]: item["value"] for item in container["env"]}
    settings = load_settings(container["args"], environ)
    # The server's own choice of threads, in a container whose cgroup quota is the CPU limit.
    monkeypatch.setattr(server_settings, "available_cpus", lambda: int(cpu_limit))
    threads = settings.resolved_intra_op_threads()
    frontends = settings.frontends
    assert frontends >= 1
    assert settings.instances * threads + (frontends if frontends > 1 else 0) == cpu_limit


def test_device_and_image(device: str, pod: Manifest, container: Manifest) -> None:
    """Each example runs the image and takes the node an overlay of the plain Deployment would."""
    env = {item["name"]: item["value"] for item in container["env"]}
    limits = container["resources"]["limits"]
    if device == "from-folder":  # the image with the exporter: the CPU image's tag, -export
        assert container["image"] == _overlay_image("cpu") + "-export"
    else:
        assert container["image"] == _overlay_image(device)
    if device == "gpu":
        assert env["ENCODER_REQUIRE_GPU"] == "true"
        assert env.get("ENCODER_DEVICE", "auto") == "auto"
        assert str(limits["nvidia.com/gpu"]) == str(container["resources"]["requests"]["nvidia.com/gpu"]) == "1"
        gpu_patch = yaml.safe_load((DEPLOY / "overlays" / "gpu" / "deployment-patch.yaml").read_text())
        gpu_pod = gpu_patch["spec"]["template"]["spec"]
        # The same nodes as deploy/overlays/gpu: GPUs the image's CUDA can run (tested there).
        assert pod["spec"]["affinity"] == gpu_pod["affinity"]
        assert pod["spec"]["tolerations"] == gpu_pod["tolerations"]
    else:
        assert env["ENCODER_DEVICE"] == "cpu"
        assert "ENCODER_REQUIRE_GPU" not in env
        assert "nvidia.com/gpu" not in limits
        assert "affinity" not in pod["spec"]
