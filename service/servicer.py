"""The KServe v2 / Triton GRPCInferenceService: each method decodes, calls the models, encodes."""

from __future__ import annotations

import time
from importlib import metadata

import grpc

from service import codec, metrics
from service.models import ModelRegistry, ServedModel
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.proto import model_config_pb2 as mc

SERVER_NAME = "encoder-serve"
EXTENSIONS = ("model_configuration", "parameters")


def _server_version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


def effective_config(model: ServedModel, instances: int) -> mc.ModelConfig:
    """config.pbtxt as served: batching limits in force, and the device and variant in use."""
    config = mc.ModelConfig()
    config.CopyFrom(model.spec.config)
    config.max_batch_size = model.policy.max_batch_size
    config.dynamic_batching.max_queue_delay_microseconds = round(model.policy.max_queue_delay_s * 1e6)
    config.dynamic_batching.default_queue_policy.max_queue_size = model.policy.max_queue_size
    del config.instance_group[:]
    kind = (
        mc.ModelInstanceGroup.KIND_GPU if model.provider == "CUDAExecutionProvider" else mc.ModelInstanceGroup.KIND_CPU
    )
    config.instance_group.add(count=instances, kind=kind)
    config.parameters["execution_provider"].string_value = model.provider
    config.parameters["variant"].string_value = model.variant
    return config


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Thin protocol layer over the model registry; errors become statuses in service.errors."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self._version = _server_version()

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        """Live as long as the process answers."""
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        """Ready when every model is loaded and warmed, and not draining."""
        return pb.ServerReadyResponse(ready=self.registry.ready and not self.registry.draining)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        """Ready when that model (and version, if given) is loaded and the server is not draining."""
        model = self.registry.models.get(request.name)
        ready = model is not None and request.version in ("", model.spec.version) and not self.registry.draining
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        """Server name, version and protocol extensions."""
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self._version, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        """Inputs (text and token forms) and outputs of a model."""
        return codec.model_metadata(self.registry.get(request.name, request.version).signature)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        """Decode and validate, run through the model's batcher, encode the requested outputs."""
        with metrics.track_request(self.registry.labels_for(request.model_name, request.model_version)):
            model = self.registry.get_for_inference(request.model_name, request.model_version)
            decoded = codec.decode_infer_request(request, model.signature)
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            result = await model.infer(decoded, deadline)
            return codec.encode_infer_response(decoded, result.outputs, model.spec)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        """The model's configuration as served."""
        model = self.registry.get(request.name, request.version)
        return pb.ModelConfigResponse(config=effective_config(model, len(model.runtimes)))

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        """Every model in the repository with its state (only READY ones if asked)."""
        response = pb.RepositoryIndexResponse()
        for state in sorted(self.registry.states.values(), key=lambda s: s.name):
            if request.ready and state.state != "READY":
                continue
            response.models.add(name=state.name, version=state.version, state=state.state, reason=state.reason)
        return response
