"""The KServe v2 / Triton GRPCInferenceService: each method decodes, calls the models, encodes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata
from typing import NoReturn

import grpc

from service import codec, metrics
from service.errors import Unimplemented
from service.models import ModelRegistry, ServedModel
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.proto import model_config_pb2 as mc
from service.statistics import CountedRequest
from service.streaming import MAX_INFLIGHT_PER_STREAM, InferenceStreams

SERVER_NAME = "encoder-serve"
EXTENSIONS = ("model_configuration", "parameters", "statistics")


def _server_version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


def _unsupported(method: str, reason: str) -> Callable[..., Awaitable[NoReturn]]:
    """A method of Triton's service that this server declares and answers UNIMPLEMENTED, saying why."""

    async def refuse(self: InferenceServicer, request: object, context: grpc.aio.ServicerContext | None) -> NoReturn:
        raise Unimplemented(f"{method} is not supported by this server: {reason}")

    refuse.__name__ = refuse.__qualname__ = method
    refuse.__doc__ = f"UNIMPLEMENTED: {reason}."
    return refuse


def effective_config(model: ServedModel) -> mc.ModelConfig:
    """config.pbtxt as served: batching limits in force, and the device and variant of every instance."""
    config = mc.ModelConfig()
    config.CopyFrom(model.spec.config)
    del config.input[:]
    config.input.extend(codec.served_inputs(model.signature))
    config.max_batch_size = model.policy.max_batch_size
    config.dynamic_batching.max_queue_delay_microseconds = round(model.policy.max_queue_delay_s * 1e6)
    config.dynamic_batching.default_queue_policy.max_queue_size = model.policy.max_queue_size
    del config.instance_group[:]
    on_gpu = [runtime for runtime in model.runtimes if runtime.provider == "CUDAExecutionProvider"]
    if on_gpu:
        gpus = sorted({runtime.settings.cuda_device_id for runtime in on_gpu})
        config.instance_group.add(count=len(on_gpu), kind=mc.ModelInstanceGroup.KIND_GPU, gpus=gpus)
    if len(on_gpu) < len(model.runtimes):
        config.instance_group.add(count=len(model.runtimes) - len(on_gpu), kind=mc.ModelInstanceGroup.KIND_CPU)
    config.parameters["execution_provider"].string_value = ",".join(sorted({r.provider for r in model.runtimes}))
    config.parameters["variant"].string_value = ",".join(sorted({r.variant for r in model.runtimes}))
    return config


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Thin protocol layer over the model registry; errors become statuses in service.errors."""

    def __init__(self, registry: ModelRegistry, max_stream_inflight: int = MAX_INFLIGHT_PER_STREAM) -> None:
        self.registry = registry
        self._version = _server_version()
        self.streams = InferenceStreams(self.infer, max_stream_inflight)
        """Open ModelStreamInfer streams; the server closes them when it drains."""

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
        """Ready when that model (and version, if given) is loaded and in service, and the server is not draining."""
        model = self.registry.models.get(request.name)
        ready = (
            model is not None
            and request.version in ("", model.spec.version)
            and model.batcher.serving
            and not self.registry.draining
        )
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
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        return await self.infer(request, deadline)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream run as ModelInfer runs it, answered in order with its id."""
        async for response in self.streams.serve(request_iterator, context):
            yield response

    async def infer(self, request: pb.ModelInferRequest, deadline: float | None) -> pb.ModelInferResponse:
        """One inference, for ModelInfer and for each message of a stream: decode, run, encode, count."""
        model_metrics = self.registry.metrics_for(request.model_name, request.model_version)
        with metrics.TrackedRequest(model_metrics, deadline):
            model = self.registry.get_for_inference(request.model_name, request.model_version)
            with CountedRequest(model.statistics) as counted:
                decoded = codec.decode_infer_request(request, model.signature)
                result = await model.infer(decoded, deadline)
                counted.inferred(decoded.rows, result.queue_s, result.compute_s)
                return codec.encode_infer_response(decoded, result.outputs, model.spec)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        """The model's configuration as served."""
        model = self.registry.get(request.name, request.version)
        return pb.ModelConfigResponse(config=effective_config(model))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        """Triton's cumulative inference statistics of one model (and version), or of every model if no name."""
        if request.name:
            models = [self.registry.get(request.name, request.version)]
        else:
            models = [model for _, model in sorted(self.registry.models.items())]
        return pb.ModelStatisticsResponse(
            model_stats=[model.statistics.to_proto(model.spec.name, model.spec.version) for model in models]
        )

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

    RepositoryModelLoad = _unsupported("RepositoryModelLoad", "models are loaded at start from --model-repository")
    RepositoryModelUnload = _unsupported("RepositoryModelUnload", "models are loaded at start from --model-repository")
    SystemSharedMemoryStatus = _unsupported("SystemSharedMemoryStatus", "tensors travel inside the messages")
    SystemSharedMemoryRegister = _unsupported("SystemSharedMemoryRegister", "tensors travel inside the messages")
    SystemSharedMemoryUnregister = _unsupported("SystemSharedMemoryUnregister", "tensors travel inside the messages")
    CudaSharedMemoryStatus = _unsupported("CudaSharedMemoryStatus", "tensors travel inside the messages")
    CudaSharedMemoryRegister = _unsupported("CudaSharedMemoryRegister", "tensors travel inside the messages")
    CudaSharedMemoryUnregister = _unsupported("CudaSharedMemoryUnregister", "tensors travel inside the messages")
    TraceSetting = _unsupported("TraceSetting", "use the Prometheus metrics and --log-level DEBUG timings")
    LogSettings = _unsupported("LogSettings", "logging is set at start with --log-level")
