"""The ASGI application of the HTTP port: routing, bounded bodies, the envelope's door, errors to statuses.

Four route families share it, each in its own body dialect: OpenAI's under /v1, Cohere's (/v2/embed,
and /v1/rerank as Cohere and Jina answer it), text-embeddings-inference's (/embed, /similarity,
/rerank, /predict, /tokenize, /decode, /info) and KServe v2 REST under /v2. Every route is one row
of the route table (routes.py): its handlers, its error dialect, whether it is traced and whether
it is open without a key. Each request enters its envelope (service.envelope) once, where it is
received (stamped, its span started, the port's own first refusals made, its key checked), runs its
inferences inside it, as the gRPC port's do, and ends it once its answer is sent; errors map to
statuses and, by the route's dialect, bodies in one table (errors.py), which a span's status is
also read from.
Metadata, configuration, statistics and the repository index are the gRPC port's own messages
(service.frontends.codec) written in Triton's JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from protocol import grpc_service_pb2 as pb
from service import envelope
from service.envelope import Envelope, RequestEnvelope, StatusOf
from service.errors import INTERNAL_MESSAGE, InvalidArgument, NotFound, Overloaded, RequestTooLarge, ServiceError
from service.frontends import codec
from service.frontends.http import cohere, kserve, openai, tasks, tei
from service.frontends.http.errors import Dialect, MethodNotAllowed, UnsupportedMediaType, error_answer
from service.frontends.http.routes import Route, RouteTable
from service.ops import metrics, tracing

log = logging.getLogger(__name__)

JSON = "application/json"
BINARY = "application/octet-stream"
CLIENT_CLOSED = "499"
"""The status label of requests whose client left before the answer (nginx's code for it; nothing is sent)."""
RETRY_AFTER_S = b"1"
"""Retry-After (seconds) on 429 (queue full) and 503 (draining, model unavailable)."""
SEND_PART_BYTES = 256 * 1024
"""A large body is sent in parts of this size (see HttpApp._send_body)."""
SEND_KEY = "send the header 'Authorization: Bearer <key>'"
"""How an HTTP caller sends its API key (the end of the refusal's message)."""
_MODEL = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
"""A KServe model's path: its name, and a version where given."""
_UNSUPPORTED_ROUTES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("/v2/repository/models/{name}/load", r"/v2/repository/models/[^/]+/load", ("POST",), "RepositoryModelLoad"),
    ("/v2/repository/models/{name}/unload", r"/v2/repository/models/[^/]+/unload", ("POST",), "RepositoryModelUnload"),
    *(
        (f"/v2/{kind}sharedmemory/{action}", rf"/v2/{kind}sharedmemory(/region/[^/]+)?/{action}", (method,), rpc)
        for kind, memory in (("system", "SystemSharedMemory"), ("cuda", "CudaSharedMemory"))
        for action, method, rpc in (
            ("status", "GET", f"{memory}Status"),
            ("register", "POST", f"{memory}Register"),
            ("unregister", "POST", f"{memory}Unregister"),
        )
    ),
    ("/v2/trace/setting", r"/v2(/models/[^/]+)?/trace/setting", ("GET", "POST"), "TraceSetting"),
    ("/v2/logging", r"/v2/logging", ("GET", "POST"), "LogSettings"),
)
"""Triton's REST routes this server declares but does not offer: (route template, path pattern, methods,
the gRPC method whose UNIMPLEMENTED reason they answer, with 501)."""
_TEI_TASKS = (
    ("/embed", tei.embed, True),
    ("/embed_all", tei.embed_all, True),
    ("/embed_sparse", tei.embed_sparse, True),
    ("/similarity", tei.similarity, True),
    ("/rerank", tei.rerank, True),
    ("/predict", tei.predict, True),
    ("/tokenize", tei.tokenize, False),
    ("/decode", tei.decode, False),
)
"""text-embeddings-inference's task routes: (path, route, traced)."""

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Response:
    """What one request is answered with."""

    status: int
    body: bytes = b""
    content_type: str | None = JSON
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class Call:
    """One request as the handlers see it: its envelope, its route's parameters, headers (lower-case names) and body."""

    envelope: RequestEnvelope
    path_params: dict[str, str]
    headers: dict[bytes, bytes]
    body: bytes


Handler = Callable[[Call], Awaitable[Response]]


class _Disconnected(Exception):
    """The client went away before its request was read or answered: nothing is sent."""


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise InvalidArgument(f"the request body is not valid JSON: {error}") from error


def _media_type(headers: dict[bytes, bytes]) -> str | None:
    value = headers.get(b"content-type")
    return None if value is None else value.split(b";")[0].strip().lower().decode("latin-1")


def _check_body_form(headers: dict[bytes, bytes], accepted: tuple[str | None, ...]) -> None:
    """Refuse bodies in a content type or encoding the route does not read (415)."""
    media_type = _media_type(headers)
    if media_type not in accepted:
        names = " or ".join(kind for kind in accepted if kind is not None)
        raise UnsupportedMediaType(f"content type {media_type or '(none)'} is not accepted here: send {names}")
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding != b"identity":
        raise UnsupportedMediaType(f"content encoding {encoding.decode('latin-1')} is not supported: send it as is")


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (uvicorn answers receive() so once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class HttpApp:
    """The HTTP port's ASGI application: its route families over the same envelope and engine as the gRPC port."""

    def __init__(
        self,
        door: Envelope,
        max_body_bytes: int,
        max_embedding_inputs: int,
        max_concurrent_requests: int,
    ) -> None:
        self.envelope = door
        self.pipeline = pipeline = door.pipeline
        self.max_concurrent_requests = max_concurrent_requests
        self.active_requests = 0
        """Requests being read, run or answered now (the open routes' excepted)."""
        self._metadata = json.dumps(kserve.proto_json(codec.server_metadata())).encode()
        self.max_body_bytes = max_body_bytes
        self.max_embedding_inputs = max_embedding_inputs
        self.created = int(time.time())
        self.info = tei.InfoSettings(
            max_concurrent_requests=max_concurrent_requests,
            max_client_batch_size=max_embedding_inputs,
            tokenization_workers=pipeline.settings.tokenizer_threads,
            version=codec.server_metadata().version,
        )
        self.routes = RouteTable(self._route_rows())
        self._statuses = {dialect: self._status_of(dialect) for dialect in Dialect}
        """The status of a request's outcome on a route of each dialect, for its span (its envelope asks it)."""

    def _route_rows(self) -> tuple[Route, ...]:
        """Every route of the port: the one table of paths, handlers, error dialects, tracing and open routes."""
        openai_, cohere_, tei_, kserve_ = Dialect.OPENAI, Dialect.COHERE, Dialect.TEI, Dialect.KSERVE
        return (
            Route("/v1/embeddings", {"POST": self._embeddings}, openai_, traced=True),
            Route("/v1/models", {"GET": self._openai_models}, openai_),
            Route("/v1/models/{name}", {"GET": self._openai_model}, openai_),
            Route("/v1/rerank", {"POST": self._task(cohere.rerank)}, cohere_, traced=True),
            Route("/v2/embed", {"POST": self._task(cohere.embed)}, cohere_, traced=True),
            *(Route(path, {"POST": self._task(task)}, tei_, traced=traced) for path, task, traced in _TEI_TASKS),
            Route("/info", {"GET": self._info}, tei_),
            Route("/v2/health/live", {"GET": self._live}, kserve_, open=True),
            Route("/v2/health/ready", {"GET": self._ready}, kserve_, open=True),
            Route("/v2", {"GET": self._server_metadata}, kserve_),
            Route("/v2/models/stats", {"GET": self._statistics}, kserve_),
            Route("/v2/repository/index", {"POST": self._repository_index}, kserve_),
            Route("/v2/models/{name}", {"GET": self._model_metadata}, kserve_, pattern=_MODEL),
            Route("/v2/models/{name}/ready", {"GET": self._model_ready}, kserve_, pattern=f"{_MODEL}/ready"),
            Route("/v2/models/{name}/config", {"GET": self._model_config}, kserve_, pattern=f"{_MODEL}/config"),
            Route("/v2/models/{name}/stats", {"GET": self._statistics}, kserve_, pattern=f"{_MODEL}/stats"),
            Route("/v2/models/{name}/infer", {"POST": self._infer}, kserve_, traced=True, pattern=f"{_MODEL}/infer"),
            *(
                Route(template, dict.fromkeys(methods, self._refusal(rpc)), kserve_, pattern=pattern)
                for template, pattern, methods, rpc in _UNSUPPORTED_ROUTES
            ),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one HTTP request (uvicorn runs each in its own task)."""
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        route, params = self.routes.match(path)
        counted = not route.open  # the probes' answers are never refused for load
        if counted:
            self.active_requests += 1
            metrics.HTTP_REQUESTS_ACTIVE.set(self.active_requests)
        headers = dict(scope["headers"])
        request = response = failure = None
        try:
            try:
                authorization = headers.get(b"authorization")
                request = self.envelope.request(
                    tracing.http_span(method, route.template, scope["headers"]) if route.traced else None,
                    self._statuses[route.dialect],
                    authorization=None if authorization is None else authorization.decode("latin-1"),
                    send_key=None if route.open else SEND_KEY,
                    refuse_first=partial(self._refuse_first, route, method, path, counted=counted),
                )
                response = await self._answer(scope, receive, route, params, headers=headers, request=request)
            except _Disconnected:
                metrics.HTTP_REQUESTS.labels(route.template, CLIENT_CLOSED).inc()
                return
            except Exception as error:
                client = scope.get("client")
                peer = f"{client[0]}:{client[1]}" if client else ""
                failure = error
                response = self._error(route.dialect, envelope.failed(error, f"{method} {path}", peer))
            metrics.HTTP_REQUESTS.labels(route.template, str(response.status)).inc()
            headers_out = [(b"content-length", str(len(response.body)).encode()), *response.headers]
            if response.content_type is not None:
                headers_out.append((b"content-type", response.content_type.encode()))
            await send({"type": "http.response.start", "status": response.status, "headers": headers_out})
            await self._send_body(send, response.body)
        finally:
            # The answer was sent, or never will be: its bytes leave the budget, its span ends.
            if request is not None:
                request.end(_Disconnected() if response is None else failure)
            if counted:
                self.active_requests -= 1
                metrics.HTTP_REQUESTS_ACTIVE.set(self.active_requests)

    @staticmethod
    def _status_of(dialect: Dialect) -> StatusOf:
        """The port's one table as the envelope asks it, on a route of `dialect`: the status a request answered with."""

        def status(error: BaseException | None, deadline: float | None) -> int:
            if error is None:
                return 200  # a traced route answers 200 or an error
            if isinstance(error, (_Disconnected, asyncio.CancelledError)):
                return int(CLIENT_CLOSED)
            answered = error if isinstance(error, ServiceError) else ServiceError(INTERNAL_MESSAGE)  # as `failed` says
            return error_answer(dialect, answered)[0]

        return status

    @staticmethod
    async def _send_body(send: Send, body: bytes) -> None:
        """Send a body; a large one in parts, each once the connection has taken most of the one before.

        uvicorn waits for a slow reader before a write, never after one: the last send returns once
        the body is in the connection's buffer. Written in parts and closed with an empty part, a
        large answer is out of the buffer (all but its last part) when this returns, so it stays in
        the answer budget while a client that reads slowly holds it.
        """
        if len(body) <= SEND_PART_BYTES:
            await send({"type": "http.response.body", "body": body})
            return
        for start in range(0, len(body), SEND_PART_BYTES):
            await send({"type": "http.response.body", "body": body[start : start + SEND_PART_BYTES], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _refuse_first(self, route: Route, method: str, path: str, *, counted: bool) -> None:
        """The port's own refusals, before a key is asked for: at its concurrency limit, no such route or method."""
        if counted and self.active_requests > self.max_concurrent_requests:
            raise Overloaded(
                f"{self.active_requests - 1} HTTP requests are being served, the most this server takes at once"
                " (--max-concurrent-http-requests); retry later",
                "http_concurrency",
            )
        if not route.handlers:
            raise NotFound(
                f"no route {path}: this server answers OpenAI's /v1/embeddings and /v1/models, /v1/rerank,"
                " text-embeddings-inference's /embed, /similarity, /rerank, /predict, /tokenize, /decode and /info,"
                " and KServe v2 REST under /v2"
            )
        if method not in route.handlers:
            allowed = tuple(route.handlers)
            raise MethodNotAllowed(f"{path} answers {' and '.join(allowed)}, not {method}", allowed)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        route: Route,
        params: dict[str, str],
        *,
        headers: dict[bytes, bytes],
        request: RequestEnvelope,
    ) -> Response:
        method = scope["method"]
        handler = route.handlers[method]
        if method != "POST":
            return await handler(Call(request, params, headers, b""))
        if route.template.endswith("/infer"):
            # The model is named by the path: a full queue answers before the body is read or parsed.
            self.pipeline.check_room(params["name"], params["version"])
        body = await self._read_body(headers, receive)
        # Cancelling the handler when the client goes away drops its queued work, as for gRPC.
        work = asyncio.ensure_future(handler(Call(request, params, headers, body)))
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            work.cancel()
            await asyncio.wait((work,))  # let it unwind: its queued work leaves the queue
            raise _Disconnected
        finally:
            gone.cancel()
            work.cancel()  # when this task itself is cancelled (a drain past its grace period)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        """The whole body, refused (413) as soon as it is known to exceed max_body_bytes (ops.message_limits)."""
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            self._too_large(int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self, size: int) -> None:
        raise RequestTooLarge(
            f"the request body is {size} bytes or more, over the limit of {self.max_body_bytes} bytes"
            " (--max-message-bytes, raised to carry an image of --max-image-bytes where a model takes images)",
            "message_too_large",
        )

    @staticmethod
    def _error(dialect: Dialect, error: ServiceError) -> Response:
        status, body = error_answer(dialect, error)
        headers = []
        if isinstance(error, MethodNotAllowed):
            headers.append((b"allow", ", ".join(error.allowed).encode()))
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if isinstance(error, Overloaded) and error.retry_after_s is not None:
            # A tenant over its limit, or a full queue: when a retry may be let in.
            headers.append((b"retry-after", str(error.retry_after_s).encode()))
        elif status in (429, 503):
            # Queue full or draining: worth another try soon (on this pod or, behind a Service, another).
            headers.append((b"retry-after", RETRY_AFTER_S))
        if status == 413:
            # The rest of an oversized body is never read: close the connection rather than parse it.
            headers.append((b"connection", b"close"))
        return Response(status, json.dumps(body).encode(), headers=headers)

    async def _embeddings(self, call: Call) -> Response:
        def parse() -> openai.EmbeddingsRequest:
            _check_body_form(call.headers, (JSON,))
            return openai.parse_embeddings(_json(call.body))

        request = call.envelope.decode(parse)
        return Response(200, await openai.embeddings(call.envelope, request, self.max_embedding_inputs))

    def _task(self, route: Callable[[tasks.TaskCall, object], Awaitable[bytes]]) -> Handler:
        """A handler for a task route (TEI's, /v1/rerank): a JSON body in, the route's JSON answer out."""

        async def handler(call: Call) -> Response:
            def parse() -> object:
                _check_body_form(call.headers, (JSON,))
                return _json(call.body)

            payload = call.envelope.decode(parse)
            task_call = tasks.TaskCall(call.envelope, self.max_embedding_inputs)
            return Response(200, await route(task_call, payload))

        return handler

    async def _info(self, call: Call) -> Response:
        return Response(200, tei.info(self.pipeline, self.info))

    async def _openai_models(self, call: Call) -> Response:
        return Response(200, openai.models_list(self.pipeline, self.created))

    async def _openai_model(self, call: Call) -> Response:
        return Response(200, openai.model_card(self.pipeline, call.path_params["name"], self.created))

    async def _live(self, call: Call) -> Response:
        return Response(200, content_type=None)

    async def _ready(self, call: Call) -> Response:
        return Response(200 if self.pipeline.ready else 503, content_type=None)

    async def _server_metadata(self, call: Call) -> Response:
        return Response(200, self._metadata)

    async def _model_metadata(self, call: Call) -> Response:
        metadata = codec.model_metadata(self.pipeline.model(**call.path_params).signature)
        return Response(200, json.dumps(kserve.proto_json(metadata)).encode())

    async def _model_ready(self, call: Call) -> Response:
        return Response(200 if self.pipeline.model_ready(**call.path_params) else 503, content_type=None)

    async def _model_config(self, call: Call) -> Response:
        config = codec.effective_config(self.pipeline.model(**call.path_params))
        return Response(200, json.dumps(kserve.proto_json(config)).encode())

    async def _statistics(self, call: Call) -> Response:
        # /v2/models/stats has no path parameters: every model's statistics, as ModelStatistics without a name.
        figures = self.pipeline.statistics(**call.path_params)
        statistics = pb.ModelStatisticsResponse(model_stats=[codec.model_statistics(*model) for model in figures])
        return Response(200, json.dumps(kserve.proto_json(statistics, every_field=True)).encode())

    async def _repository_index(self, call: Call) -> Response:
        _check_body_form(call.headers, (None, JSON))
        ready_only = kserve.parse_repository_index(_json(call.body) if call.body.strip() else {})
        index = codec.repository_index(self.pipeline.index(ready_only))
        return Response(200, json.dumps([kserve.proto_json(model) for model in index.models]).encode())

    @staticmethod
    def _refusal(rpc: str) -> Handler:
        """A handler answering as the gRPC port's `rpc` does: UNIMPLEMENTED with its reason, here 501."""

        async def refusal(call: Call) -> Response:
            raise codec.unsupported(rpc)

        return refusal

    async def _infer(self, call: Call) -> Response:
        def parse() -> kserve.RestInferRequest:
            header_length = call.headers.get(kserve.HEADER_LENGTH.encode())
            _check_body_form(call.headers, (None, JSON, BINARY))
            json_part, binary = kserve.split_body(
                call.body, None if header_length is None else header_length.decode("latin-1")
            )
            payload = _json(json_part)
            return kserve.parse_infer(payload, binary, call.path_params["name"], call.path_params["version"])

        rest = call.envelope.decode(parse)
        async with call.envelope.inference(rest.request) as inference:
            result = inference.result
            body, json_length = await inference.encode(lambda: kserve.encode_outputs(rest, result))
        if json_length is None:
            return Response(200, body)
        header = (kserve.HEADER_LENGTH.encode(), str(json_length).encode())
        return Response(200, body, BINARY, [header])
