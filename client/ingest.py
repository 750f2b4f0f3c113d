"""Bulk ingestion: every text of a file, or every image, embedded once, in input order, through restarts and crashes.

Rows are sent in batches over `ModelStreamInfer` streams (one per connection) or concurrent
`ModelInfer` calls, at the model's lowest priority by default (bulk work: interactive requests go
first), as many in flight as keep the server busy (client.window) and at most `in_flight`. A batch
the server refuses for a while (RESOURCE_EXHAUSTED, UNAVAILABLE: a full queue, a drain, a restart)
is sent again after a jittered backoff; a stream the server ends (a drain, the stream's age) is
opened again and the batches it had not answered are sent again; a batch a stream answered with an
error is sent once more as a ModelInfer call, whose status says whether it can be retried. Each
answer is written at its rows' places (client.checkpoint), so nothing is written twice and a gap is
impossible at the end; the checkpoint lets `resume` do only the rows not yet written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
import numpy as np

from client.aio import AsyncEmbeddingClient
from client.base import DEFAULT_MODEL
from client.checkpoint import Checkpoint
from client.errors import EmbeddingError, error_of, refused_index, rpc_error
from client.images import IMAGE_REQUEST_BYTES
from client.inputs import DEFAULT_FIELD, ImageFile, ImageInput, InputError, InputFile
from client.progress import Progress
from client.protocol import image_request, output_array, prompt_tokens, text_request
from client.retry import RetryPolicy
from client.tasks import EmbedOptions
from client.window import AdaptiveWindow
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol.channel_security import ClientSecurity

TRANSPORTS = ("stream", "unary")
INGEST_RETRY = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=2.0)
"""Patient: a restart or a rollout may keep every address away for a while (about 5 minutes at most)."""
CHECKPOINT_INTERVAL_S = 2.0
GRPC_WRITE_RACE_DETAILS = "Internal error from Core"
"""What grpcio's asyncio client says when a write meets the server's end of a stream (see _stream_end)."""
OUTPUT_FORMATS = (".npy", ".parquet")


@dataclass(frozen=True)
class IngestSettings:
    """How an ingestion sends its rows."""

    batch_size: int = 64
    """Texts or images per request (images: IMAGE_REQUEST_BYTES of them at most, but one)."""
    connections: int = 2
    """Connections to the server (to each address of a dns:/// target)."""
    in_flight: int = 16
    """Requests unanswered per connection at most (the server holds up to --max-stream-inflight, 32); below it the
    window follows the server's queue (client.window)."""
    transport: str = "stream"
    """stream (ModelStreamInfer) or unary (ModelInfer)."""
    timeout_s: float = 60.0
    """Each ModelInfer call's deadline."""
    priority: int = 0
    """The priority the rows wait at, 1 the highest; 0: the model's lowest (bulk work)."""
    retry: RetryPolicy = INGEST_RETRY
    """How long a refused batch, or a stream that ended, is tried again before the run fails."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if min(self.batch_size, self.connections, self.in_flight) < 1:
            raise ValueError("batch_size, connections and in_flight must be at least 1")
        if self.priority < 0:
            raise ValueError("priority must be 1 (the highest) or more, or 0 for the model's lowest")


@dataclass(frozen=True)
class Batch:
    """Some rows of the input: their numbers (ascending) and texts, or encoded images and their files' names."""

    number: int
    rows: np.ndarray
    items: list[str] | list[bytes]
    names: tuple[str, ...] = ()
    """Each image's file (and the line that named it); empty for texts."""

    @property
    def images(self) -> bool:
        """Whether the rows are images."""
        return bool(self.names)

    def where(self, index: int | None = None) -> str:
        """The rows for messages: the row at `index` in the batch where it is known, else all of them.

        Texts by their input lines (1-based), images by their files.
        """
        if index is not None and 0 <= index < len(self.rows):
            return self.names[index] if self.images else f"line {self.rows[index] + 1}"
        if len(self.rows) == 1:
            return self.names[0] if self.images else f"line {self.rows[0] + 1}"
        if self.images:
            return f"images {self.names[0]} to {self.names[-1]}"
        return f"lines {self.rows[0] + 1}-{self.rows[-1] + 1}"


class WorkQueue:
    """The batches still to answer: the ones to send again first, then the file's next ones.

    `take` returns None once every batch is answered (none left, none out).
    """

    def __init__(self, batches: Iterator[Batch]) -> None:
        self._fresh = batches
        self._again: collections.deque[Batch] = collections.deque()
        self._out = 0
        self._changed = asyncio.Event()

    async def take(self) -> Batch | None:
        """The next batch to send, or None when all are answered."""
        while True:
            batch = self._again.popleft() if self._again else next(self._fresh, None)
            if batch is not None:
                self._out += 1
                return batch
            if self._out == 0:
                return None
            self._changed.clear()
            await self._changed.wait()

    def answered(self) -> None:
        """A batch taken is answered."""
        self._out -= 1
        self._changed.set()

    def send_again(self, batch: Batch) -> None:
        """A batch taken must be sent again."""
        self._out -= 1
        self._again.append(batch)
        self._changed.set()


def batches_of(rows: Iterator[str] | Iterator[ImageFile], skip: Checkpoint, size: int) -> Iterator[Batch]:
    """The rows not yet finished, in batches of `size` in input order.

    Images: IMAGE_REQUEST_BYTES a batch at most (but one), each file read as its batch is made.
    """
    numbers: list[int] = []
    items: list = []
    names: list[str] = []
    batch_bytes = 0
    number = 0
    for row, item in enumerate(rows):
        if row in skip.finished:
            continue
        image_bytes = item.size if isinstance(item, ImageFile) else 0
        if items and (len(items) == size or batch_bytes + image_bytes > IMAGE_REQUEST_BYTES):
            yield Batch(number, np.array(numbers), items, tuple(names))
            number, numbers, items, names, batch_bytes = number + 1, [], [], [], 0
        numbers.append(row)
        batch_bytes += image_bytes
        if isinstance(item, ImageFile):
            items.append(_read(item))
            names.append(item.name)
        else:
            items.append(item)
    if items:
        yield Batch(number, np.array(numbers), items, tuple(names))


def _read(image: ImageFile) -> bytes:
    try:
        return image.path.read_bytes()
    except OSError as error:
        raise InputError(f"{image.name}: {error.strerror}") from None


@dataclass
class Ingestion:
    """One run: its client, its work, where answers go, its progress."""

    client: AsyncEmbeddingClient
    model: str
    options: EmbedOptions
    settings: IngestSettings
    checkpoint: Checkpoint
    progress: Progress
    priority: int
    """The priority its rows wait at."""

    def request(self, batch: Batch) -> pb.ModelInferRequest:
        """The batch's request, with its number as id."""
        request_id = str(batch.number)
        if batch.images:
            parameters = self.options.image_parameters() | {"priority": self.priority}
            return image_request(self.model, batch.items, ["embedding"], parameters=parameters, request_id=request_id)
        parameters = self.options.parameters() | {"priority": self.priority}
        return text_request(self.model, batch.items, ["embedding"], parameters=parameters, request_id=request_id)

    def store(self, batch: Batch, response: pb.ModelInferResponse) -> None:
        """Write the batch's vectors at its rows."""
        vectors = output_array(response, "embedding")
        if vectors.shape[0] != len(batch.rows):
            raise EmbeddingError(grpc.StatusCode.INTERNAL, f"{len(vectors)} vectors for {len(batch.rows)} rows")
        self.checkpoint.write(batch.rows, vectors)
        self.progress.advance(len(batch.rows), prompt_tokens(response))

    async def unary(self, batch: Batch) -> None:
        """Answer a batch with ModelInfer calls, retried; a refusal names the row it refuses (else the batch's)."""
        try:
            response = await self.client.infer(self.request(batch))
        except EmbeddingError as error:
            raise type(error)(error.code, f"{batch.where(refused_index(error.message))}: {error.message}") from error
        self.store(batch, response)

    async def unary_worker(self, work: WorkQueue, window: AdaptiveWindow) -> None:
        """Send batches one at a time, while the window has room, until the work is done."""
        while True:
            await window.acquire()
            batch = await work.take()
            if batch is None:
                window.release()
                return
            sent = time.monotonic()
            try:
                await self.unary(batch)
            except BaseException:
                window.release()
                raise
            window.release(time.monotonic() - sent)
            work.answered()

    async def stream_worker(self, stub: pb_grpc.GRPCInferenceServiceStub, work: WorkQueue) -> None:
        """Keep one stream open on a connection until the work is done, opening it again whenever it ends."""
        failures = 0
        while True:
            ended, answered_any = await self._one_stream(stub, work)
            if ended is None:
                return
            # A stream that answered some ended at a drain or its age: open the next one at once, or nearly.
            failures = 1 if answered_any else failures + 1
            delay_s = self.settings.retry.delay_s(ended, failures)
            if delay_s is None:
                raise ended
            await asyncio.sleep(delay_s)

    async def _one_stream(
        self, stub: pb_grpc.GRPCInferenceServiceStub, work: WorkQueue
    ) -> tuple[EmbeddingError | None, bool]:
        """One stream until the work is done (None) or it ends (its error); and whether it answered any batch."""
        pending: dict[str, Batch] = {}
        sent: dict[str, float] = {}
        window = AdaptiveWindow(self.settings.in_flight)
        call = stub.ModelStreamInfer(metadata=self.client.call_metadata)
        answered_any = False

        async def send() -> None:
            while True:
                await window.acquire()
                batch = await work.take()
                if batch is None:
                    await _half_close(call)
                    return
                pending[str(batch.number)] = batch  # before any wait: a cancelled send never loses it
                sent[str(batch.number)] = time.monotonic()
                await call.write(self.request(batch))

        sender = asyncio.create_task(send())
        try:
            async for answer in call:
                batch = pending.pop(answer.infer_response.id)
                latency_s = time.monotonic() - sent.pop(answer.infer_response.id)
                if answer.error_message:  # a stream carries no status: ask again alone, where there is one
                    self.progress.resent += 1
                    await self.unary(batch)
                    latency_s = None
                else:
                    self.store(batch, answer.infer_response)
                work.answered()
                window.release(latency_s)
                answered_any = True
            code = await call.code()
            if code != grpc.StatusCode.OK:
                return _stream_end(error_of(code, await call.details())), answered_any
            await sender
            return None, answered_any
        except grpc.aio.AioRpcError as failure:
            return _stream_end(rpc_error(failure)), answered_any
        except asyncio.InvalidStateError:  # the stream ended while a request was being written to it
            code, details = await call.code(), await call.details()
            if code == grpc.StatusCode.OK:  # ended by the server before its last answer was read: send again
                return error_of(grpc.StatusCode.UNAVAILABLE, f"the stream ended with OK: {details}"), answered_any
            return _stream_end(error_of(code, details)), answered_any
        finally:
            sender.cancel()
            # Its failure, if any, is the stream's end, handled above.
            with contextlib.suppress(
                asyncio.CancelledError, asyncio.InvalidStateError, grpc.aio.AioRpcError, grpc.aio.UsageError
            ):
                await sender
            call.cancel()
            for batch in pending.values():
                self.progress.resent += 1
                work.send_again(batch)

    async def run(self, work: WorkQueue) -> None:
        """Send every batch, saving the checkpoint now and then."""
        if self.settings.transport == "stream":
            stubs = self.client.connections.stubs
            workers = [self.stream_worker(stub, work) for stub in stubs]
        else:
            window = AdaptiveWindow(self.settings.in_flight * self.settings.connections)
            workers = [self.unary_worker(work, window) for _ in range(window.limit)]
        saver = asyncio.create_task(self._save_periodically())
        try:
            await _all_or_none(workers)
        finally:
            saver.cancel()
            self.checkpoint.save()

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_INTERVAL_S)
            self.checkpoint.save()


async def _half_close(call: grpc.aio.StreamStreamCall) -> None:
    """Close the stream's sending side, which the server may have ended first (a drain): that is no failure.

    grpcio's asyncio client turns a write that meets the stream's end into a status (see
    _stream_end), but lets a half-close that meets it raise grpc.aio.InternalError (its
    ExecuteBatchError). Nothing is left to send then, and the stream's status, read by the
    receiving side, says how the stream ended.
    """
    with contextlib.suppress(grpc.aio.InternalError):
        await call.done_writing()


def _stream_end(error: EmbeddingError) -> EmbeddingError:
    """How a stream ended: as it says, except grpcio's asyncio write race, which is a stream the server ended.

    A write that meets the server's end of the stream replaces the server's status with INTERNAL
    "Internal error from Core" in grpcio's asyncio client (grpc/grpc#36066): the server ended it (a
    drain or its age), so it is UNAVAILABLE here, and its unanswered batches are sent again.
    """
    if error.code == grpc.StatusCode.INTERNAL and error.message == GRPC_WRITE_RACE_DETAILS:
        return error_of(grpc.StatusCode.UNAVAILABLE, f"the stream ended while a request was written ({error.message})")
    return error


async def _all_or_none(coroutines: list[Coroutine[object, object, None]]) -> None:
    """Run them together; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class IngestReport:
    """What a run did."""

    rows: int
    """Rows in the input (= vectors in the output)."""
    embedded: int
    """Rows this run embedded (the others were done by an earlier run)."""
    seconds: float
    retries: int
    output: Path
    unit: str = "texts"
    """What a row is: texts or images."""

    @property
    def rows_per_s(self) -> float:
        """Rows embedded per second by this run."""
        return self.embedded / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Rows:
    """An input's rows, checked: how to read them, how many, what they are (the checkpoint's identity)."""

    read: Callable[[], Iterator[str]] | Callable[[], Iterator[ImageFile]]
    count: int
    identity: dict[str, object]
    unit: str


async def embed_file_async(
    source: Path,
    output: Path,
    *,
    target: str = "localhost:8001",
    model: str = DEFAULT_MODEL,
    field: str = DEFAULT_FIELD,
    column: str = DEFAULT_FIELD,
    resume: bool = False,
    options: EmbedOptions | None = None,
    settings: IngestSettings | None = None,
    security: ClientSecurity | None = None,
    progress_stream: TextIO | None = sys.stderr,
) -> IngestReport:
    """Embed every text of `source` into `output` (.npy: float32 [rows, width]; .parquet: id, embedding), in order.

    `resume`: continue the run whose checkpoint is beside `output` (same input, model and options).
    `progress_stream` None: quiet. Raises InputError for a malformed input (naming the line) and
    EmbeddingError for what the server refuses for good, or a server away for longer than
    `settings.retry` waits (naming the lines where it can, and the rows written, which `resume` keeps).
    """
    _check_output(output)
    texts = InputFile(Path(source), field, column)
    count = texts.count()
    if count == 0:
        raise InputError(f"{source}: no texts")
    stat = texts.path.stat()
    identity = {"input": str(texts.path.resolve()), "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns}
    return await _ingested(
        _Rows(texts.texts, count, identity, "texts"), output, target=target, model=model, resume=resume,
        options=options, settings=settings, security=security, progress_stream=progress_stream,
    )  # fmt: skip


async def embed_images_async(
    sources: Sequence[Path],
    output: Path,
    *,
    image_column: str | None = None,
    target: str = "localhost:8001",
    model: str = DEFAULT_MODEL,
    resume: bool = False,
    options: EmbedOptions | None = None,
    settings: IngestSettings | None = None,
    security: ClientSecurity | None = None,
    progress_stream: TextIO | None = sys.stderr,
) -> IngestReport:
    """Embed every image into `output` (.npy: float32 [rows, width]; .parquet: id, embedding), in order.

    sources: folders (their image files, every level, sorted by path) and image files; or, with `image_column`,
    one .jsonl, .csv or .parquet file whose field or column holds each row's image path (relative ones from
    that file's folder). Every image file is checked (present, not empty) before anything is sent; the
    server decodes them, and refuses a bad one naming it (client.inputs.ImageInput).
    The other arguments as embed_file_async's; a refusal names the image file.
    """
    _check_output(output)
    images = ImageInput(tuple(Path(source) for source in sources), image_column)
    count, digest = images.checked()
    if count == 0:
        raise InputError(f"{images.describe()}: no images")
    identity = {"images": images.describe(), "images_digest": digest}
    return await _ingested(
        _Rows(images.images, count, identity, "images"), output, target=target, model=model, resume=resume,
        options=options, settings=settings, security=security, progress_stream=progress_stream,
    )  # fmt: skip


def _check_output(output: Path) -> None:
    if output.suffix not in OUTPUT_FORMATS:
        raise InputError(f"{output}: the output must be one of {', '.join(OUTPUT_FORMATS)}")
    if output.suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise InputError(f"{output}: writing Parquet needs pyarrow: pip install 'encoder-serve[parquet]'")


async def _ingested(
    rows: _Rows,
    output: Path,
    *,
    target: str,
    model: str,
    resume: bool,
    options: EmbedOptions | None,
    settings: IngestSettings | None,
    security: ClientSecurity | None,
    progress_stream: TextIO | None,
) -> IngestReport:
    """Embed the rows into `output`, resuming the run of the same identity where `resume` says."""
    options = options or EmbedOptions()
    settings = settings or IngestSettings()
    client = AsyncEmbeddingClient(
        target, model, settings.timeout_s, settings.batch_size, security, connections=settings.connections,
        retry=settings.retry,
    )  # fmt: skip
    async with client:
        info = await client.model_info(model)
        width = options.dimensions or info.dimension
        if width is None:
            raise InputError(f"model {model} answers no embedding (it is a {info.task} model)")
        identity = rows.identity | {
            "rows": rows.count,
            "model": model,
            "width": width,
            "options": options.parameters(),
        }
        checkpoint = Checkpoint(output, identity, rows.count, width, resume)
        batch_size = min(settings.batch_size, info.max_batch_size or settings.batch_size)
        done_before = checkpoint.finished.count
        progress = Progress(rows.count, done_before, progress_stream, lambda: client.retries, unit=rows.unit)
        priority = settings.priority or info.priority_levels
        ingestion = Ingestion(client, model, options, settings, checkpoint, progress, priority)
        try:
            await ingestion.run(WorkQueue(batches_of(rows.read(), checkpoint, batch_size)))
        except EmbeddingError as error:
            written = f"{checkpoint.finished.count} of {rows.count} rows written: run again with --resume for the rest"
            raise type(error)(error.code, f"{error.message} ({written})", error.retry_after_s) from error
    if not checkpoint.complete():
        unwritten = f"rows left unwritten: finished {checkpoint.finished.spans} of {rows.count}"
        raise RuntimeError(unwritten)  # never expected
    _write_output(checkpoint)
    progress.finish()
    return IngestReport(rows.count, progress.done, progress.elapsed_s, progress.retries, output, rows.unit)


def _write_output(checkpoint: Checkpoint) -> None:
    """The final output from the finished partial one; then the partial output and its record go."""
    output = checkpoint.output
    if output.suffix == ".npy":
        checkpoint.vectors.flush()
        checkpoint.partial.replace(output)
    else:
        import pyarrow as pa  # noqa: PLC0415 (the optional extra: encoder-serve[parquet])
        import pyarrow.parquet as pq  # noqa: PLC0415

        vectors = np.asarray(checkpoint.vectors)
        column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
        pq.write_table(pa.table({"id": pa.array(np.arange(len(vectors))), "embedding": column}), output)
    checkpoint.discard()


def embed_file(source: Path, output: Path, **arguments: object) -> IngestReport:
    """embed_file_async, blocking (arguments as there)."""
    return asyncio.run(embed_file_async(source, output, **arguments))


def embed_images(sources: Sequence[Path], output: Path, **arguments: object) -> IngestReport:
    """embed_images_async, blocking (arguments as there)."""
    return asyncio.run(embed_images_async(sources, output, **arguments))
