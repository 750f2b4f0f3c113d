"""The KServe v2 / Triton GRPCInferenceService: each method decodes, makes one call inside the envelope, encodes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import NoReturn

import grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service import envelope
from service.envelope import Envelope, RequestEnvelope
from service.frontends import codec
from service.frontends.grpc.streaming import MAX_INFLIGHT_PER_STREAM, InferenceStreams


def _unsupported(method: str) -> Callable[..., Awaitable[NoReturn]]:
    """A method of Triton's service that this server declares and answers UNIMPLEMENTED, saying why."""

    async def refuse(self: InferenceServicer, request: object, context: grpc.aio.ServicerContext) -> NoReturn:
        raise codec.unsupported(method)

    refuse.__name__ = refuse.__qualname__ = method
    refuse.__doc__ = f"UNIMPLEMENTED: {codec.UNSUPPORTED[method]}."
    return refuse


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Thin protocol layer over the envelope and the engine; errors become statuses at the door (interceptor.py)."""

    def __init__(
        self, door: Envelope, max_stream_inflight: int = MAX_INFLIGHT_PER_STREAM, max_stream_age_s: float | None = None
    ) -> None:
        self.pipeline = door.pipeline
        self._metadata = codec.server_metadata()
        self.streams = InferenceStreams(self.infer, max_stream_inflight, max_stream_age_s)
        """Open ModelStreamInfer streams: each ends by itself at `max_stream_age_s`, all when the server drains."""

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        """Live as long as the process answers."""
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        """Ready when every model is loaded and warmed, and not draining."""
        return pb.ServerReadyResponse(ready=self.pipeline.ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        """Ready when that model (and version, if given) is loaded and in service, and the server is not draining."""
        return pb.ModelReadyResponse(ready=self.pipeline.model_ready(request.name, request.version))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        """Server name, version and protocol extensions."""
        return self._metadata

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        """Inputs (text and token forms) and outputs of a model."""
        return codec.model_metadata(self.pipeline.model(request.name, request.version).signature)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        """Decode, run through the engine, encode the requested outputs (in the call's envelope, opened at the door)."""
        return await self._answer(request, envelope.CURRENT.get())

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream run as ModelInfer runs it, answered in order with its id."""
        async for response in self.streams.serve(request_iterator, context):
            yield response

    async def infer(self, request: pb.ModelInferRequest, deadline: float | None) -> pb.ModelInferResponse:
        """One message of a stream, in an envelope of its own, ended once its answer is encoded.

        A stream's answers not yet sent are bounded by --max-stream-inflight instead.
        """
        # The stream's envelope (its tenant, its caller's trace) was opened at the door, in the task this copies.
        message = envelope.CURRENT.get().message(deadline)
        try:
            response = await self._answer(request, message)
        except BaseException as error:
            message.end(error)
            raise
        message.end()
        return response

    @staticmethod
    async def _answer(request: pb.ModelInferRequest, call: RequestEnvelope) -> pb.ModelInferResponse:
        """Decode, one inference inside the call's envelope, encode (a large answer off the event loop)."""
        decoded = call.decode(partial(codec.decode_infer_request, request))
        async with call.inference(decoded) as inference:
            return await inference.encode(partial(codec.encode_infer_response, inference.result))

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        """The model's configuration as served."""
        return pb.ModelConfigResponse(config=codec.effective_config(self.pipeline.model(request.name, request.version)))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        """Triton's cumulative inference statistics of one model (and version), or of every model if no name."""
        figures = self.pipeline.statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[codec.model_statistics(*model) for model in figures])

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        """Every model in the repository with its state (only READY ones if asked)."""
        return codec.repository_index(self.pipeline.index(request.ready))

    RepositoryModelLoad = _unsupported("RepositoryModelLoad")
    RepositoryModelUnload = _unsupported("RepositoryModelUnload")
    SystemSharedMemoryStatus = _unsupported("SystemSharedMemoryStatus")
    SystemSharedMemoryRegister = _unsupported("SystemSharedMemoryRegister")
    SystemSharedMemoryUnregister = _unsupported("SystemSharedMemoryUnregister")
    CudaSharedMemoryStatus = _unsupported("CudaSharedMemoryStatus")
    CudaSharedMemoryRegister = _unsupported("CudaSharedMemoryRegister")
    CudaSharedMemoryUnregister = _unsupported("CudaSharedMemoryUnregister")
    TraceSetting = _unsupported("TraceSetting")
    LogSettings = _unsupported("LogSettings")
