"""The engine's wire: front-end processes and the engine process over one Unix socket each.

A frame is 8 bytes (the header's length and the payload's, u32 little-endian), a msgpack header
(msgspec) holding a list of messages, then the payload: the raw bytes of every array those messages
carry, one after another, in order. Token rows go in as int64 arrays, an image tower's rows as one float32
array of pixel values (padded to a whole number of 8-byte words), outputs come back as float32 arrays:
nothing is pickled. Each side sends what one turn of its event loop produced in one frame,
so a busy server pays one write and one read for many requests; the answers of such a turn travel
as one message per shape of outputs, each output stacked into one array (a batch of one-text
requests: one message, one array).

These frames over a Unix socket cost less CPU per request on both sides than ZeroMQ
(docs/decisions.md#engine-transport). The message types, the framing and both peers (the engine's
EngineServer and EngineConnection, the front end's EngineLink) stay in this one module: they are the
two ends of one protocol, kept together so the format cannot drift between them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
from collections.abc import Callable

import msgspec
import numpy as np

from service import errors
from service.core.rows import DEFAULT_SHARE, PixelRows, Rows, Share, TokenRows, WorkResult
from service.errors import ServiceError, Unavailable

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")
_INT64 = np.dtype("<i8")
_FP32 = np.dtype("<f4")


class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front end's first message: which one it is."""

    frontend: int


class Submit(msgspec.Struct, tag=True, array_like=True):
    """One request's rows for a model: token rows, or images for its image tower (`pixels`).

    The payload holds input_ids, lengths, then the mask, the segment ids and the adapter ids where present; for
    images, their pixel values (float32, then 4 bytes of zeros where that ends mid-word).
    """

    id: int
    model: str
    version: str
    deadline: float | None
    """time.monotonic (one clock for every process of the host), or None."""
    outputs: tuple[str, ...]
    width: int
    rows: int
    tokens: int
    masked: bool
    typed: bool
    trace: bytes | None = None
    """The request's span context (service.ops.tracing.to_wire) while tracing is on: 25 bytes."""
    adapted: bool = False
    """The rows carry adapter ids (a model with task adapters, a task asked for)."""
    share: Share = DEFAULT_SHARE
    """Its priority and tenant: where it waits in the engine's queue."""
    pixels: tuple[int, ...] = ()
    """Images: one image row's shape (channels, height, width), for the model's image tower; (): token rows."""


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """The caller of a submitted request went away."""

    id: int


class Drain(msgspec.Struct, tag=True, array_like=True):
    """The front end is draining: queued rows are to run without waiting for fuller batches."""


class Failure(msgspec.Struct, array_like=True):
    """A typed error (service.errors) by class name, with its message and reason."""

    kind: str
    message: str
    reason: str | None
    retry_after_s: int | None = None
    """An Overloaded error's hint: whole seconds before a retry may be let in."""


class Answers(msgspec.Struct, tag=True, array_like=True):
    """Several requests' outputs, all of the same names and shapes.

    In the payload, each output's arrays are stacked into one float32 array whose first axis is
    the requests, in `ids` order.
    """

    ids: list[int]
    queue_s: list[float]
    compute_s: list[float]
    batch_rows: list[int]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    """Each output's name and its shape for one request."""


class Failed(msgspec.Struct, tag=True, array_like=True):
    """A request's failure."""

    id: int
    failure: Failure


class Instance(msgspec.Struct, array_like=True):
    """Where one model instance runs."""

    provider: str
    variant: str
    cuda_device_id: int


class ModelUpdate(msgspec.Struct, tag=True, array_like=True):
    """A model's state in the engine: LOADING, READY (with its batching and instances) or UNAVAILABLE."""

    name: str
    version: str
    state: str
    reason: str
    serving: bool
    policy: dict[str, bool | int | float] | None
    """BatchingPolicy's fields, once READY."""
    instances: tuple[Instance, ...]
    folder: str = ""
    """The model's folder, once READY (a repository's, or a model served by name's entry in the export cache)."""


ToEngine = Hello | Submit | Cancel | Drain
ToFrontend = Answers | Failed | ModelUpdate
_ENCODER = msgspec.msgpack.Encoder()
_TO_ENGINE = msgspec.msgpack.Decoder(list[ToEngine])
_TO_FRONTEND = msgspec.msgpack.Decoder(list[ToFrontend])
_ERRORS = {
    kind.__name__: kind for kind in vars(errors).values() if isinstance(kind, type) and issubclass(kind, ServiceError)
}


def failure_of(error: ServiceError) -> Failure:
    """A typed error as it travels."""
    return Failure(type(error).__name__, str(error), error.reason, getattr(error, "retry_after_s", None))


def error_of(failure: Failure) -> ServiceError:
    """The typed error a failure stands for."""
    kind = _ERRORS.get(failure.kind, ServiceError)
    if issubclass(kind, errors.Overloaded):
        return kind(failure.message, failure.reason, failure.retry_after_s)
    return kind(failure.message, failure.reason)


class _Outbox:
    """Messages and payload buffers queued for one connection, written as one frame per loop turn."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._messages: list[msgspec.Struct] = []
        self._buffers: list[memoryview | np.ndarray] = []
        self._packs: list[Callable[[], None]] = []
        self._scheduled = False

    def close(self) -> None:
        """Close the connection once what is queued is written."""
        self._flush()
        self._transport.close()

    def put(self, message: msgspec.Struct, *buffers: memoryview | np.ndarray) -> None:
        self._messages.append(message)
        self._buffers.extend(buffers)
        self._schedule()

    def defer(self, pack: Callable[[], None]) -> None:
        """Call `pack` (which `put`s what it gathered) just before the next frame is written."""
        self._packs.append(pack)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        while self._packs:
            self._packs.pop()()
        self._scheduled = False
        if self._transport.is_closing():
            self._messages.clear()
            self._buffers.clear()
            return
        header = encode(self._messages)
        buffers = self._buffers
        payload_length = sum(buffer.nbytes for buffer in buffers)
        self._transport.write(b"".join((_FRAME.pack(len(header), payload_length), header, *buffers)))
        self._messages.clear()
        buffers.clear()


class _Frames(asyncio.Protocol):
    """Reads frames from a stream socket and hands each (header, payload) on, whole."""

    def __init__(self) -> None:
        self._received = bytearray()

    def data_received(self, data: bytes) -> None:
        received = self._received
        received += data
        start = 0
        while len(received) - start >= _FRAME.size:
            header_length, payload_length = _FRAME.unpack_from(received, start)
            header_end = start + _FRAME.size + header_length
            end = header_end + payload_length
            if end > len(received):
                break
            self.frame(bytes(received[start + _FRAME.size : header_end]), bytes(received[header_end:end]))
            start = end
        if start:
            del received[:start]

    def frame(self, header: bytes, payload: bytes) -> None:
        """One whole frame."""
        raise NotImplementedError


def encode(messages: list[msgspec.Struct]) -> bytes:
    """A frame's header: its messages."""
    return _ENCODER.encode(messages)


def decode_to_engine(header: bytes) -> list[ToEngine]:
    """The messages of a frame a front end sent."""
    return _TO_ENGINE.decode(header)


def decode_to_frontend(header: bytes) -> list[ToFrontend]:
    """The messages of a frame the engine sent."""
    return _TO_FRONTEND.decode(header)


def submit_message(
    request_id: int,
    model: str,
    version: str,
    rows: Rows,
    outputs: tuple[str, ...],
    *,
    deadline: float | None,
    trace: bytes | None = None,
    share: Share = DEFAULT_SHARE,
) -> tuple[Submit, list[memoryview]]:
    """A request's rows as they travel: the message and its arrays."""
    if isinstance(rows, PixelRows):
        pixels = np.ascontiguousarray(rows.pixel_values, _FP32)
        buffers = [memoryview(pixels).cast("B")]
        if pixels.size % 2:
            buffers.append(memoryview(bytes(_FP32.itemsize)))
        shape = tuple(pixels.shape[1:])
        message = Submit(request_id, model, version, deadline, outputs, 1, rows.rows, 0, False, False, trace)
        message.share, message.pixels = share, shape
        return message, buffers
    buffers = [
        memoryview(np.ascontiguousarray(rows.input_ids, _INT64)),
        memoryview(np.ascontiguousarray(rows.lengths, _INT64)),
    ]
    for optional in (rows.attention_mask, rows.token_type_ids, rows.adapter_ids):
        if optional is not None:
            buffers.append(memoryview(np.ascontiguousarray(optional, _INT64)))
    message = Submit(
        request_id,
        model,
        version,
        deadline,
        outputs,
        rows.width,
        rows.rows,
        len(rows.input_ids),
        rows.attention_mask is not None,
        rows.token_type_ids is not None,
        trace,
        rows.adapter_ids is not None,
        share,
    )
    return message, buffers


def answer_messages(answers: list[tuple[int, WorkResult]]) -> list[tuple[Answers, list[np.ndarray]]]:
    """Requests' outputs as they travel back: one message per shape of outputs, with each output's arrays stacked.

    One message and one array per output for a batch's worth of one-text requests, instead of one
    of each per request.
    """
    groups: dict[tuple[tuple[str, tuple[int, ...]], ...], list[tuple[int, WorkResult]]] = {}
    for answer in answers:
        shapes = []
        for name, output in answer[1].outputs.items():  # a loop: cheaper than a comprehension's frame here
            shapes.append((name, output.shape))
        groups.setdefault(tuple(shapes), []).append(answer)
    messages = []
    for shapes, group in groups.items():
        results = [result for _, result in group]
        message = Answers(
            [request_id for request_id, _ in group],
            [result.queue_s for result in results],
            [result.compute_s for result in results],
            [result.batch_rows for result in results],
            shapes,
        )
        stacked = [np.concatenate([result.outputs[name] for result in results], dtype=_FP32) for name, _ in shapes]
        messages.append((message, stacked))
    return messages


def answered(message: Answers, payload: bytes, offset: int) -> tuple[list[WorkResult], int]:
    """An Answers message's outputs from the payload at `offset` (views, no copy), and the offset after them."""
    count = len(message.ids)
    stacked = []
    for name, shape in message.outputs:
        size = math.prod(shape) * count
        stacked.append((name, np.frombuffer(payload, _FP32, size, offset).reshape((count, *shape))))
        offset += size * _FP32.itemsize
    results = [
        WorkResult({name: array[index] for name, array in stacked}, queue_s, compute_s, batch_rows)
        for index, (queue_s, compute_s, batch_rows) in enumerate(
            zip(message.queue_s, message.compute_s, message.batch_rows, strict=True)
        )
    ]
    return results, offset


def rows_of(message: Submit, words: np.ndarray, offset: int) -> tuple[Rows, int]:
    """A Submit's rows from a frame's payload read as int64 `words`, at word `offset` (views, no copy).

    Returns the rows and the offset after them. Slicing one array per frame costs less than reading
    each request's arrays from the bytes.
    """
    if message.pixels:
        values = message.rows * math.prod(message.pixels)
        end = offset + -(-values // 2)
        pixels = words[offset:end].view(_FP32)[:values].reshape((message.rows, *message.pixels))
        return PixelRows(pixels), end
    tokens, end = message.tokens, offset + message.tokens
    ids = words[offset:end]
    lengths = words[end : end + message.rows]
    offset = end + message.rows
    mask = types = adapters = None
    if message.masked:
        mask = words[offset : offset + tokens]
        offset += tokens
    if message.typed:
        types = words[offset : offset + tokens]
        offset += tokens
    if message.adapted:
        adapters = words[offset : offset + tokens]
        offset += tokens
    return TokenRows(ids, lengths, message.width, mask, types, adapters), offset


class EngineConnection(_Frames):
    """The engine's end of one front end's socket."""

    def __init__(self, server: EngineServer) -> None:
        super().__init__()
        self._server = server
        self.outbox: _Outbox | None = None
        self.frontend: int | None = None
        self._answers: list[tuple[int, WorkResult]] = []
        """Outputs gathered in this loop turn, sent together just before the frame is written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A front end connected."""
        self.outbox = _Outbox(transport)

    def connection_lost(self, error: Exception | None) -> None:
        """The front end's socket closed (it stopped, or died)."""
        self._server.lost(self)

    def frame(self, header: bytes, payload: bytes) -> None:
        """Submits, cancels, a drain and a hello from the front end."""
        offset = 0
        words = np.frombuffer(payload, _INT64)
        for message in decode_to_engine(header):
            if isinstance(message, Submit):
                rows, offset = rows_of(message, words, offset)
                self._server.on_submit(self, message, rows)
            elif isinstance(message, Cancel):
                self._server.on_cancel(self, message.id)
            elif isinstance(message, Drain):
                self._server.on_drain()
            else:
                self.frontend = message.frontend
                self._server.hello(self)

    def answer(self, request_id: int, result: WorkResult) -> None:
        """Send a request's outputs back (with every other answer of this loop turn)."""
        if not self._answers:
            self.outbox.defer(self._send_answers)
        self._answers.append((request_id, result))

    def _send_answers(self) -> None:
        answers, self._answers = self._answers, []
        for message, stacked in answer_messages(answers):
            self.outbox.put(message, *stacked)

    def fail(self, request_id: int, error: ServiceError) -> None:
        """Send a request's failure back."""
        self.outbox.put(Failed(request_id, failure_of(error)))

    def update(self, update: ModelUpdate) -> None:
        """Tell the front end a model's state."""
        self.outbox.put(update)


class EngineServer:
    """The engine's listening socket: every front end's connection, and what to do with their messages."""

    def __init__(
        self,
        on_submit: Callable[[EngineConnection, Submit, Rows], None],
        on_cancel: Callable[[EngineConnection, int], None],
        on_lost: Callable[[EngineConnection], None],
        on_drain: Callable[[], None],
    ) -> None:
        self.on_submit = on_submit
        self.on_cancel = on_cancel
        self.on_drain = on_drain
        self._on_lost = on_lost
        self.connections: set[EngineConnection] = set()
        self._updates: dict[str, ModelUpdate] = {}
        self._server: asyncio.AbstractServer | None = None
        self._introduced = asyncio.Event()

    async def start(self, path: str) -> None:
        """Listen on the socket path."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: EngineConnection(self), path)

    def hello(self, connection: EngineConnection) -> None:
        """A front end introduced itself: it hears every model's state, now and on each change."""
        self.connections.add(connection)
        for update in self._updates.values():
            connection.update(update)
        self._introduced.set()

    async def all_connected(self, frontends: int) -> None:
        """Return once `frontends` front ends have introduced themselves."""
        while len(self.connections) < frontends:
            self._introduced.clear()
            await self._introduced.wait()

    def publish(self, update: ModelUpdate) -> None:
        """A model's state changed: every front end hears it (and every later one)."""
        self._updates[update.name] = update
        for connection in self.connections:
            connection.update(update)

    def lost(self, connection: EngineConnection) -> None:
        """A front end's socket closed."""
        self.connections.discard(connection)
        self._on_lost(connection)

    def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()


class EngineLink(_Frames):
    """A front end's end of its socket to the engine: submit rows, await their outputs, hear model states."""

    def __init__(self, on_update: Callable[[ModelUpdate], None], on_lost: Callable[[], None]) -> None:
        super().__init__()
        self._on_update = on_update
        self._on_lost = on_lost
        self._outbox: _Outbox | None = None
        self._pending: dict[int, asyncio.Future[WorkResult]] = {}
        self._next_id = 0
        self.connected = False

    @classmethod
    async def connect(
        cls, path: str, frontend: int, on_update: Callable[[ModelUpdate], None], on_lost: Callable[[], None]
    ) -> EngineLink:
        """Connect to the engine's socket and introduce this front end."""
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(lambda: cls(on_update, on_lost), path)
        link._outbox.put(Hello(frontend))
        return link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Connected to the engine."""
        self._outbox = _Outbox(transport)
        self.connected = True

    def connection_lost(self, error: Exception | None) -> None:
        """The engine's socket closed: every request waiting on it fails UNAVAILABLE."""
        self.connected = False
        gone = Unavailable("the engine process is gone; this server is stopping")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        self._on_lost()

    def submit(
        self,
        model: str,
        version: str,
        rows: Rows,
        outputs: tuple[str, ...],
        deadline: float | None,
        *,
        trace: bytes | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> tuple[int, asyncio.Future[WorkResult]]:
        """Send a request's rows (its span context, its share); the future resolves with its outputs or its error."""
        if not self.connected:
            raise Unavailable("the engine process is gone; this server is stopping")
        self._next_id += 1
        request_id = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        message, buffers = submit_message(
            request_id, model, version, rows, outputs, deadline=deadline, trace=trace, share=share
        )
        self._outbox.put(message, *buffers)
        return request_id, future

    def close(self) -> None:
        """Close the socket (the front end has stopped)."""
        if self._outbox is not None:
            self._outbox.close()

    def drain(self) -> None:
        """Tell the engine this front end drains: it runs queued rows without waiting for fuller batches."""
        if self.connected:
            self._outbox.put(Drain())

    def cancel(self, request_id: int) -> None:
        """The caller went away: the engine drops what is left of the request."""
        if self._pending.pop(request_id, None) is not None and self.connected:
            self._outbox.put(Cancel(request_id))

    def frame(self, header: bytes, payload: bytes) -> None:
        """Results and model states from the engine."""
        offset = 0
        pending = self._pending
        for message in decode_to_frontend(header):
            if isinstance(message, Answers):
                results, offset = answered(message, payload, offset)
                for request_id, result in zip(message.ids, results, strict=True):
                    future = pending.pop(request_id, None)
                    if future is not None and not future.done():  # else cancelled meanwhile
                        future.set_result(result)
            elif isinstance(message, Failed):
                future = pending.pop(message.id, None)
                if future is not None and not future.done():
                    future.set_exception(error_of(message.failure))
            else:
                self._on_update(message)
