"""OpenTelemetry tracing through real servers, exported to a real OTLP receiver on loopback.

A request sent with a W3C `traceparent` must arrive at the receiver as spans of that trace: the
request's span (the caller's span its parent), its stages as children, and a batch span linked to
it; over gRPC (unary and stream) and HTTP (OpenAI and KServe REST), with one process and with the
engine in a process of its own. Off, a server starts no exporter thread and sends nothing; a
receiver that is down fails no request, and the spans it never got are counted.
"""

from __future__ import annotations

import json
import secrets
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.ops.tracing import EXPORTER_THREAD_NAME
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, free_port, metric_samples, server_pids, start_server

STAGES = ("decode", "validate", "tokenize", "queue", "encode")
WAIT_S = 30.0
"""Bounds a wait for spans that should come (the processors export every 50 ms here); never what is asserted."""
GRPC_SERVICE = "inference.GRPCInferenceService"
STATUS_ERROR = 2
"""opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR."""


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


@dataclass(frozen=True)
class ReceivedSpan:
    """A span as the receiver got it, ids in hex."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, object]
    links: tuple[tuple[str, str], ...]
    status_code: int
    resource: dict[str, object] = field(hash=False)


class SpanStore:
    """Spans received so far, and a way to wait for the ones a test expects."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {item.key: _value(item.value) for item in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.name,
                            {item.key: _value(item.value) for item in span.attributes},
                            tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            span.status.code,
                            resource,
                        )
                    )
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [span for span in self._spans if span.trace_id == trace_id]

    def wait(self, trace_ids: str | set[str], ready: Callable[[list[ReceivedSpan]], bool]) -> list[ReceivedSpan]:
        """The spans of a trace (or of several) once `ready` holds for them (AssertionError if it never does)."""
        wanted = {trace_ids} if isinstance(trace_ids, str) else trace_ids
        deadline = time.monotonic() + WAIT_S
        with self._changed:
            while True:
                spans = [span for span in self._spans if span.trace_id in wanted]
                if ready(spans):
                    return spans
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"traces {wanted}: {[(s.name, s.parent_id) for s in spans]}")
                self._changed.wait(remaining)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: SpanStore) -> None:
        self._store = store

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._store.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class Receiver:
    """An OTLP receiver on loopback and the spans it got."""

    endpoint: str
    spans: SpanStore


@pytest.fixture(scope="module")
def grpc_receiver() -> Iterator[Receiver]:
    """OTLP/gRPC: opentelemetry.proto's TraceService on a loopback port."""
    store = SpanStore()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Receiver(f"http://127.0.0.1:{port}", store)
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def http_receiver() -> Iterator[Receiver]:
    """OTLP/HTTP (protobuf): POST /v1/traces on a loopback port."""
    store = SpanStore()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path != "/v1/traces":
                self.send_response(404)
            else:
                store.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Receiver(f"http://127.0.0.1:{server.server_port}", store)
    finally:
        server.shutdown()
        server.server_close()


def tracing_env(endpoint: str, **extra: str) -> dict[str, str]:
    """The OTEL_* variables of a traced test server: every span sampled, exported every 50 ms."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "encoder-test",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SDK_DISABLED": "false",
        **extra,
    }


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-frontends"])
def traced_server(
    request: pytest.FixtureRequest,
    grpc_receiver: Receiver,
    tiny_repository: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """A traced server, as one process (--frontends 1) or as an engine and two front ends."""
    log = tmp_path_factory.mktemp("traced") / "server.log"
    # A short batching delay, so rows sent together share a batch.
    arguments = ("--frontends", request.param, "--max-queue-delay-us", "100000")
    with start_server(tiny_repository, log, *arguments, env=tracing_env(grpc_receiver.endpoint)) as server:
        yield server


BATCH_ROWS = 4
"""Rows per batch of `filling_server`: four one-text requests fill one."""


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-frontends"])
def filling_server(
    request: pytest.FixtureRequest,
    grpc_receiver: Receiver,
    tiny_repository: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """A traced server whose batches run only once they fill (BATCH_ROWS rows; the delay is ten minutes).

    Requests sent together meet in one batch because it waits for them, not because they arrive within a
    delay that a slow machine could outlast.
    """
    log = tmp_path_factory.mktemp("traced-filling") / "server.log"
    arguments = ("--frontends", request.param, "--max-batch-size", str(BATCH_ROWS), "--max-queue-delay-us", "600000000")
    with start_server(tiny_repository, log, *arguments, env=tracing_env(grpc_receiver.endpoint)) as server:
        yield server


def new_parent() -> tuple[str, str, str]:
    """A caller's trace id and span id (hex), and the traceparent header naming them (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def text_request(texts: list[str], model: str = TINY_MODEL) -> pb.ModelInferRequest:
    raw = b"".join(struct.pack("<I", len(text.encode())) + text.encode() for text in texts)
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[raw])
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    request.outputs.add(name="embedding")
    return request


def post(url: str, body: dict[str, object], traceparent: str) -> dict[str, object]:
    request = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {"content-type": "application/json", "traceparent": traceparent, "tracestate": "caller=1"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _complete(server_span_name: str, requests: int = 1) -> Callable[[list[ReceivedSpan]], bool]:
    """The trace holds `requests` request spans, each with every stage, and batch spans linking to all of them."""

    def ready(spans: list[ReceivedSpan]) -> bool:
        roots = [span for span in spans if span.name == server_span_name]
        if len(roots) < requests:
            return False
        linked = {link for span in spans if span.name == "batch" for link in span.links}
        for root in roots:
            stages = {span.name for span in spans if span.parent_id == root.span_id}
            if not set(STAGES) <= stages or (root.trace_id, root.span_id) not in linked:
                return False
        return True

    return ready


def check_request_trace(
    spans: list[ReceivedSpan], name: str, caller_span: str, rows: int, frontends: str
) -> list[ReceivedSpan]:
    """The request spans under the caller's span: attributes, stages, the batch's link; returns them."""
    requests = [span for span in spans if span.name == name]
    assert requests, [span.name for span in spans]
    for request in requests:
        assert request.parent_id == caller_span
        assert request.attributes["encoder.model"] == TINY_MODEL
        assert request.attributes["encoder.rows"] == rows
        assert request.attributes["encoder.tokens"] >= rows
        assert request.attributes["encoder.batch_size"] >= rows
        assert request.resource["service.name"] == "encoder-test"
        children = {span.name: span for span in spans if span.parent_id == request.span_id}
        assert set(STAGES) <= set(children), sorted(children)
        assert children["queue"].attributes["encoder.batch_size"] == request.attributes["encoder.batch_size"]
        batches = [span for span in spans if (request.trace_id, request.span_id) in span.links]
        assert len(batches) == 1, batches
        batch = batches[0]
        assert batch.attributes["encoder.model"] == TINY_MODEL
        assert batch.attributes["encoder.batch_size"] >= rows
        assert batch.attributes["encoder.batch_tokens"] >= batch.attributes["encoder.tokens"] >= rows
        assert batch.parent_id in {span.span_id for span in requests}  # the child of the first request in it
        # With several front ends the batch runs in the engine process, the request in a front end.
        expected_roles = ("server", "server") if frontends == "1" else ("engine", "frontend")
        assert batch.resource["encoder.role"] == expected_roles[0]
        assert str(request.resource["encoder.role"]).startswith(expected_roles[1])
    return requests


def frontends_of(server: RunningServer) -> str:
    """The server's --frontends (a lone front end may still be two processes: Envoy's under a supervisor)."""
    arguments = list(server.process.args)
    return arguments[arguments.index("--frontends") + 1]


def test_a_grpc_request_joins_the_callers_trace(traced_server: RunningServer, grpc_receiver: Receiver) -> None:
    trace_id, caller_span, traceparent = new_parent()
    with grpc.insecure_channel(traced_server.target) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            text_request(["one text", "and another"]), metadata=(("traceparent", traceparent),), timeout=30
        )
    assert response.outputs[0].shape == [2, 32]
    spans = grpc_receiver.spans.wait(trace_id, _complete(f"{GRPC_SERVICE}/ModelInfer"))
    (request,) = check_request_trace(
        spans, f"{GRPC_SERVICE}/ModelInfer", caller_span, rows=2, frontends=frontends_of(traced_server)
    )
    assert request.attributes["rpc.method"] == "ModelInfer"
    assert request.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert request.status_code != STATUS_ERROR


def test_requests_of_a_stream_each_get_a_span_in_the_streams_trace(
    traced_server: RunningServer, grpc_receiver: Receiver
) -> None:
    trace_id, caller_span, traceparent = new_parent()
    with grpc.insecure_channel(traced_server.target) as channel:
        stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([text_request(["first"]), text_request(["second"])]),
            metadata=(("traceparent", traceparent),),
            timeout=30,
        )
        answers = list(stream)
    assert [answer.error_message for answer in answers] == ["", ""]
    name = f"{GRPC_SERVICE}/ModelStreamInfer"
    spans = grpc_receiver.spans.wait(trace_id, _complete(name, requests=2))
    requests = check_request_trace(spans, name, caller_span, rows=1, frontends=frontends_of(traced_server))
    assert len(requests) == 2


def test_a_failed_request_has_its_status_on_its_span(traced_server: RunningServer, grpc_receiver: Receiver) -> None:
    trace_id, caller_span, traceparent = new_parent()
    with grpc.insecure_channel(traced_server.target) as channel, pytest.raises(grpc.RpcError) as failed:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            text_request(["x"], model="no-such-model"), metadata=(("traceparent", traceparent),), timeout=30
        )
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    name = f"{GRPC_SERVICE}/ModelInfer"
    spans = grpc_receiver.spans.wait(trace_id, lambda spans: any(span.name == name for span in spans))
    (request,) = [span for span in spans if span.name == name]
    assert request.parent_id == caller_span
    assert request.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert request.attributes["encoder.model"] == "no-such-model"
    assert request.status_code == STATUS_ERROR


def test_an_openai_request_joins_the_callers_trace(traced_server: RunningServer, grpc_receiver: Receiver) -> None:
    trace_id, caller_span, traceparent = new_parent()
    body = {"model": TINY_MODEL, "input": ["one", "two", "three"]}
    answer = post(f"{traced_server.http_url}/v1/embeddings", body, traceparent)
    assert len(answer["data"]) == 3
    name = "POST /v1/embeddings"
    spans = grpc_receiver.spans.wait(trace_id, _complete(name))
    (request,) = check_request_trace(spans, name, caller_span, rows=3, frontends=frontends_of(traced_server))
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["http.route"] == "/v1/embeddings"
    assert request.attributes["encoder.tokens"] == answer["usage"]["prompt_tokens"]


def test_a_kserve_rest_request_joins_the_callers_trace(traced_server: RunningServer, grpc_receiver: Receiver) -> None:
    trace_id, caller_span, traceparent = new_parent()
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a sentence"]}]}
    answer = post(f"{traced_server.http_url}/v2/models/{TINY_MODEL}/infer", body, traceparent)
    assert answer["outputs"]
    name = "POST /v2/models/{name}/infer"
    spans = grpc_receiver.spans.wait(trace_id, _complete(name))
    (request,) = check_request_trace(spans, name, caller_span, rows=1, frontends=frontends_of(traced_server))
    assert request.attributes["http.response.status_code"] == 200


def test_one_batch_span_links_every_request_it_ran(filling_server: RunningServer, grpc_receiver: Receiver) -> None:
    parents = [new_parent() for _ in range(BATCH_ROWS)]
    with grpc.insecure_channel(filling_server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            stub.ModelInfer.future(text_request([f"text {i}"]), metadata=(("traceparent", parent),), timeout=30)
            for i, (_, _, parent) in enumerate(parents)
        ]
        for call in calls:
            call.result()
    name = f"{GRPC_SERVICE}/ModelInfer"
    # A batch span is in the trace of the first request it ran: wait for the four traces together.
    spans = grpc_receiver.spans.wait({trace_id for trace_id, _, _ in parents}, _complete(name, requests=len(parents)))
    request_spans = [span for span in spans if span.name == name]
    batches = {span.span_id: span for span in spans if span.name == "batch"}
    covered = [link for batch in batches.values() for link in batch.links]
    assert sorted(covered) == sorted((span.trace_id, span.span_id) for span in request_spans)
    for batch in batches.values():
        assert batch.parent_id in {span_id for _, span_id in batch.links}  # the child of a request it ran
    for batch in batches.values():
        assert batch.attributes["encoder.requests"] == len(batch.links) == batch.attributes["encoder.batch_size"]
    assert len(batches) == 1  # the four filled one batch, which waited for them


def exporter_threads(server: RunningServer) -> list[str]:
    """The server's threads (in every process) named as the exporter's thread."""
    names = []
    for pid in server_pids(server):
        for task in Path(f"/proc/{pid}/task").iterdir():
            comm = (task / "comm").read_text().strip()
            if comm == EXPORTER_THREAD_NAME:
                names.append(f"{pid}/{task.name}")
    return names


def test_a_traced_server_exports_from_one_thread_per_process(traced_server: RunningServer) -> None:
    # The supervisor (with two front ends) serves only /metrics: the engine and each front end export.
    processes = len(server_pids(traced_server))
    assert len(exporter_threads(traced_server)) == (1 if processes == 1 else processes - 1)


def test_off_no_exporter_thread_and_no_span(grpc_receiver: Receiver, tiny_repository: Path, tmp_path: Path) -> None:
    trace_id, _, traceparent = new_parent()
    # The receiver's address is given, and the SDK disabled: nothing may reach it.
    env = tracing_env(grpc_receiver.endpoint, OTEL_SDK_DISABLED="true")
    server = start_server(tiny_repository, tmp_path / "server.log", "--frontends", "2", env=env)
    try:
        with grpc.insecure_channel(server.target) as channel:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                text_request(["untraced"]), metadata=(("traceparent", traceparent),), timeout=30
            )
        assert exporter_threads(server) == []
        assert not [name for name, _ in metric_samples(server) if name.startswith("encoder_trace_spans_dropped")]
    finally:
        assert server.stop() == 0  # a tracing server would export what it still holds as it stops
    assert grpc_receiver.spans.of_trace(trace_id) == []


def test_a_default_server_has_no_exporter_thread(tiny_server: RunningServer) -> None:
    assert server_pids(tiny_server)
    assert exporter_threads(tiny_server) == []


def dropped(server: RunningServer) -> float:
    samples = metric_samples(server)
    return sum(value for (name, _), value in samples.items() if name == "encoder_trace_spans_dropped_total")


def test_a_receiver_that_is_down_fails_no_request(tiny_repository: Path, tmp_path: Path) -> None:
    # Nothing listens there; a queue of 4 spans fills with the first request's.
    env = tracing_env(
        f"http://127.0.0.1:{free_port()}",
        OTEL_BSP_MAX_QUEUE_SIZE="4",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
    )
    with start_server(tiny_repository, tmp_path / "server.log", "--frontends", "1", env=env) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for index in range(8):
                _, _, traceparent = new_parent()
                response = stub.ModelInfer(
                    text_request([f"text {index}"]), metadata=(("traceparent", traceparent),), timeout=30
                )
                assert response.outputs[0].shape == [1, 32]
        # 8 requests x 7 spans through a queue of 4 that cannot be emptied: most are dropped, and counted.
        deadline = time.monotonic() + WAIT_S
        # Uncounted at any moment: what the queue holds (4) and the batch being exported (4).
        while dropped(server) < 8 * 7 - 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = metric_samples(server)
        queue_full = samples[("encoder_trace_spans_dropped_total", (("reason", "queue_full"),))]
        export_failed = samples[("encoder_trace_spans_dropped_total", (("reason", "export_failed"),))]
        assert queue_full > 0
        assert queue_full + export_failed >= 8 * 7 - 8


def test_otlp_over_http_with_the_flag(http_receiver: Receiver, tiny_repository: Path, tmp_path: Path) -> None:
    env = tracing_env("", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    del env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    arguments = ("--frontends", "1", "--otlp-endpoint", http_receiver.endpoint)
    with start_server(tiny_repository, tmp_path / "server.log", *arguments, env=env) as server:
        trace_id, caller_span, traceparent = new_parent()
        post(f"{server.http_url}/v1/embeddings", {"model": TINY_MODEL, "input": "over http"}, traceparent)
        spans = http_receiver.spans.wait(trace_id, _complete("POST /v1/embeddings"))
        check_request_trace(spans, "POST /v1/embeddings", caller_span, rows=1, frontends=frontends_of(server))
