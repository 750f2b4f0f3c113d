"""Dynamic batching: one bounded queue per model and one consumer loop.

Callers `submit` token arrays and await their own rows back. The consumer waits for an idle
model instance, then forms a batch: the oldest request plus the queued requests closest to its
length, up to `max_batch_size` rows and `max_batch_tokens` padded tokens, waiting no longer than
`max_queue_delay` after the oldest arrived. Cancelled and expired requests are dropped before
running. Every batch resolves every one of its futures, with results or with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service import metrics
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, Unavailable
from service.metrics import ModelLabels

log = logging.getLogger(__name__)


class Runner(Protocol):
    """A model instance: runs one padded batch, blocking, and returns the named outputs."""

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Run a batch."""
        ...


@dataclass(frozen=True)
class BatchingPolicy:
    """Limits that shape batches and the queue."""

    max_batch_size: int
    """Rows per batch."""
    max_batch_tokens: int
    """Padded tokens (rows x longest) per batch; a single request may exceed it alone."""
    max_queue_delay_s: float
    """Longest the oldest request waits for a fuller batch."""
    max_queue_size: int
    """Requests waiting before new ones are rejected."""
    length_bucket: int = 1
    """Batch length is rounded up to a multiple of this (bounds the shapes a GPU sees)."""
    pad_token_id: int = 0


@dataclass(frozen=True)
class WorkResult:
    """A request's own rows of each requested output, and where its time went."""

    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_rows: int


@dataclass(eq=False)
class WorkItem:
    """One queued request: int64 [rows, length] token arrays and the future awaiting them."""

    tokens: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    future: asyncio.Future[WorkResult]
    deadline: float | None
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        """Sequences in the request."""
        return self.tokens["input_ids"].shape[0]

    @property
    def length(self) -> int:
        """The request's (padded) sequence length."""
        return self.tokens["input_ids"].shape[1]


@dataclass(frozen=True)
class _Submitted:
    """A batch handed to a model instance: when, the padded feed, and its future outputs."""

    started: float
    feed: dict[str, np.ndarray]
    results: asyncio.Future[dict[str, np.ndarray]]


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def select_batch(pending: Sequence[WorkItem], policy: BatchingPolicy) -> list[WorkItem]:
    """The oldest item plus the items nearest its length that fit the row and token budgets."""
    anchor = pending[0]
    chosen = [anchor]
    rows, longest = anchor.rows, anchor.length
    nearest_first = sorted(range(1, len(pending)), key=lambda i: (abs(pending[i].length - anchor.length), i))
    for index in nearest_first:
        if rows >= policy.max_batch_size:
            break
        item = pending[index]
        new_rows, new_longest = rows + item.rows, max(longest, item.length)
        padded = new_rows * _round_up(new_longest, policy.length_bucket)
        if new_rows > policy.max_batch_size or padded > policy.max_batch_tokens:
            continue
        chosen.append(item)
        rows, longest = new_rows, new_longest
    return chosen


class Batcher:
    """The queue and consumer loop of one model."""

    def __init__(
        self,
        runners: Sequence[Runner],
        policy: BatchingPolicy,
        labels: ModelLabels,
        output_names: tuple[str, ...],
    ) -> None:
        self.policy = policy
        self._labels = labels.values()
        self._output_names = output_names
        self._pending: list[WorkItem] = []
        self._arrived = asyncio.Event()
        self._idle: asyncio.Queue[Runner] = asyncio.Queue()
        for runner in runners:
            self._idle.put_nowait(runner)
        self._executor = ThreadPoolExecutor(max_workers=len(runners), thread_name_prefix=f"model-{labels.model}")
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        self._consumer: asyncio.Task[None] | None = None
        metrics.QUEUE_CAPACITY.labels(*self._labels).set(policy.max_queue_size)
        metrics.QUEUE_DEPTH.labels(*self._labels).set(0)

    def start(self) -> None:
        """Start the consumer loop on the running event loop."""
        self._consumer = asyncio.get_running_loop().create_task(self._consume(), name=f"batcher-{self._labels[0]}")

    async def submit(
        self, tokens: dict[str, np.ndarray], outputs: tuple[str, ...], deadline: float | None
    ) -> WorkResult:
        """Queue a request and wait for its rows; rejects at once when the queue is full."""
        if self._closing:
            raise Unavailable("the model is shutting down")
        if len(self._pending) >= self.policy.max_queue_size:
            raise Overloaded(f"queue full: {len(self._pending)} requests waiting; retry later")
        item = WorkItem(tokens, outputs, asyncio.get_running_loop().create_future(), deadline)
        self._pending.append(item)
        metrics.QUEUE_DEPTH.labels(*self._labels).set(len(self._pending))
        self._arrived.set()
        return await item.future

    async def close(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running batches finish (up to timeout_s), then stop."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)
        self._fail(self._pending, Unavailable("the server shut down before this request ran"))
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            runner = await self._idle.get()
            try:
                items = await self._collect()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never die quietly: fail what is queued and keep serving.
                log.exception("batch formation failed")
                self._fail(self._pending, ModelFailure("batch formation failed; see the server log"))
                self._pending.clear()
                self._idle.put_nowait(runner)
                continue
            # Submitted here, in the step that formed the batch, so the model restarts before the
            # previous batch's responses are encoded; a task then waits for the result.
            task = loop.create_task(self._execute(runner, items, self._submit(loop, runner, items)))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _submit(self, loop: asyncio.AbstractEventLoop, runner: Runner, items: list[WorkItem]) -> _Submitted:
        started = time.monotonic()
        try:
            feed = self._pad(items)
        except Exception as error:
            failed: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
            failed.set_exception(error)
            return _Submitted(started, {}, failed)
        wanted = tuple(name for name in self._output_names if any(name in item.outputs for item in items))
        return _Submitted(started, feed, loop.run_in_executor(self._executor, runner.run, feed, wanted))

    async def _collect(self) -> list[WorkItem]:
        """Wait for work, then for a fuller batch until the oldest request's delay is spent."""
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            self._drop_dead()
            if not self._pending:
                continue
            dispatch_at = self._pending[0].enqueued_at + self.policy.max_queue_delay_s
            while not self._full():
                remaining = dispatch_at - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
            self._drop_dead()
            if self._pending:
                chosen = select_batch(self._pending, self.policy)
                taken = set(map(id, chosen))
                self._pending = [item for item in self._pending if id(item) not in taken]
                metrics.QUEUE_DEPTH.labels(*self._labels).set(len(self._pending))
                return chosen

    def _full(self) -> bool:
        rows = sum(item.rows for item in self._pending)
        if rows >= self.policy.max_batch_size:
            return True
        longest = max(item.length for item in self._pending)
        return rows * longest >= self.policy.max_batch_tokens

    def _drop_dead(self) -> None:
        """Remove cancelled requests and fail expired ones, counting both."""
        now = time.monotonic()
        alive = []
        for item in self._pending:
            if item.future.done():
                metrics.DROPPED.labels(*self._labels, "cancelled").inc()
            elif item.deadline is not None and item.deadline <= now:
                item.future.set_exception(DeadlineExceeded("the request's timeout passed while it was queued"))
                metrics.DROPPED.labels(*self._labels, "expired").inc()
            else:
                alive.append(item)
        if len(alive) != len(self._pending):
            self._pending = alive
            metrics.QUEUE_DEPTH.labels(*self._labels).set(len(alive))

    def _pad(self, items: list[WorkItem]) -> dict[str, np.ndarray]:
        rows = sum(item.rows for item in items)
        length = _round_up(max(item.length for item in items), self.policy.length_bucket)
        feed = {
            "input_ids": np.full((rows, length), self.policy.pad_token_id, dtype=np.int64),
            "attention_mask": np.zeros((rows, length), dtype=np.int64),
            "token_type_ids": np.zeros((rows, length), dtype=np.int64),
        }
        row = 0
        for item in items:
            for name, array in item.tokens.items():
                feed[name][row : row + item.rows, : item.length] = array
            row += item.rows
        return feed

    async def _execute(self, runner: Runner, items: list[WorkItem], submitted: _Submitted) -> None:
        started, feed = submitted.started, submitted.feed
        try:
            results = await submitted.results
        except Exception as error:
            log.exception("model execution failed for a batch of %d requests", len(items))
            self._fail(items, ModelFailure(f"model execution failed: {error}"))
            return
        finally:
            self._idle.put_nowait(runner)
        compute_s = time.monotonic() - started
        self._record(items, feed, started, compute_s)
        row = 0
        for item in items:
            if not item.future.done():
                own = {}
                for name in item.outputs:
                    block = results[name][row : row + item.rows]
                    own[name] = block[:, : item.length] if block.ndim == 3 else block
                item.future.set_result(
                    WorkResult(own, started - item.enqueued_at, compute_s, feed["input_ids"].shape[0])
                )
            row += item.rows

    def _record(self, items: list[WorkItem], feed: dict[str, np.ndarray], started: float, compute_s: float) -> None:
        rows, length = feed["input_ids"].shape
        real_tokens = int(feed["attention_mask"].sum())
        labels = self._labels
        metrics.COMPUTE_DURATION.labels(*labels).observe(compute_s)
        metrics.BATCH_SIZE.labels(*labels).observe(rows)
        metrics.PADDING_RATIO.labels(*labels).observe(1.0 - real_tokens / (rows * length))
        metrics.SEQUENCES.labels(*labels).inc(rows)
        metrics.TOKENS.labels(*labels).inc(real_tokens)
        queue_histogram = metrics.QUEUE_DURATION.labels(*labels)
        for item in items:
            queue_histogram.observe(started - item.enqueued_at)

    @staticmethod
    def _fail(items: list[WorkItem], error: Exception) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
