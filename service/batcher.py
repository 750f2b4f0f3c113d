"""Dynamic batching: one bounded queue per model and one consumer loop.

Callers `admit` a request (rejected at once when the queue is full), then `submit` its token
arrays and await their own rows back. The consumer waits for an idle model instance, then forms
a batch: the oldest request plus the queued requests closest to its length, up to
`max_batch_size` rows and `max_batch_tokens` padded tokens, waiting no longer than
`max_queue_delay` after the oldest arrived. Cancelled and expired requests leave the queue at
once and never run. Every batch resolves every one of its futures, with results or with an
error; a run that does not return within `max_batch_run_s` fails its requests and takes its
instance out of service until it does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service import metrics, statistics
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, Unavailable
from service.metrics import ModelLabels

log = logging.getLogger(__name__)

DEADLINE_CLOCK_SLACK_S = 0.05
"""gRPC cancels a call at its deadline by its own clock, which differs by milliseconds from the deadline
the server derives from `time_remaining()` (measured here: gRPC cancelled up to ~8 ms before it). A
caller that goes away this close to its deadline, or after it, is counted as expired, not cancelled."""


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
    max_batch_run_s: float = 120.0
    """A run taking longer fails its requests and retires its instance until it returns."""
    max_length: int = 0
    """Bucketed lengths never exceed this (the model's max_sequence_length); 0 = no cap."""

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest row is `longest` is padded to: bucketed, capped at max_length."""
        bucketed = _round_up(longest, self.length_bucket)
        return min(bucketed, max(self.max_length, longest)) if self.max_length else bucketed


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


@dataclass
class _Submitted:
    """A batch handed to a model instance: when, the padded feed, and its future outputs."""

    started: float
    feed: dict[str, np.ndarray]
    results: asyncio.Future[dict[str, np.ndarray]]
    overran: bool = False
    """Set when the run exceeded max_batch_run_s (its requests were failed, its instance retired)."""


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
        padded = new_rows * policy.padded_length(new_longest)
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
        self._stopped = False
        self._consumer: asyncio.Task[None] | None = None
        self._admitted = 0
        """Requests admitted and not yet queued (being tokenised): they hold a queue place."""
        self._instances = len(runners)
        self._stuck = 0
        self.on_serving_change: Callable[[bool], None] | None = None
        """Told False when every instance is stuck, True when one comes back."""
        metrics.QUEUE_CAPACITY.labels(*self._labels).set(policy.max_queue_size)
        metrics.QUEUE_DEPTH.labels(*self._labels).set(0)
        metrics.STUCK_INSTANCES.labels(*self._labels).set(0)

    def start(self) -> None:
        """Start the consumer loop on the running event loop."""
        self._consumer = asyncio.get_running_loop().create_task(self._consume(), name=f"batcher-{self._labels[0]}")

    @property
    def serving(self) -> bool:
        """Whether at least one instance is in service (not stuck in an overlong run)."""
        return self._stuck < self._instances

    def admit(self) -> None:
        """Take a queue place for a request about to be prepared; refuses at once when there is none.

        Every admitted request is then either submitted (`submit(..., admitted=True)`) or
        `withdraw`n.
        """
        if self._closing:
            raise Unavailable("the model is shutting down")
        if not self.serving:
            raise Unavailable("no model instance is in service (every one is stuck in an overlong run)", "no_instance")
        waiting = len(self._pending) + self._admitted
        if waiting >= self.policy.max_queue_size:
            raise Overloaded(
                f"queue full: {waiting} requests waiting (--max-queue-size {self.policy.max_queue_size}); retry later",
                "queue_full",
            )
        self._admitted += 1

    def withdraw(self) -> None:
        """Give back the place of an admitted request that will not be submitted."""
        self._admitted -= 1

    async def submit(
        self, tokens: dict[str, np.ndarray], outputs: tuple[str, ...], deadline: float | None, admitted: bool = False
    ) -> WorkResult:
        """Queue token arrays and wait for their rows.

        `admitted`: the request's place was taken by `admit`; False for the later parts of a
        request already admitted (they re-enter the queue without a capacity check). New requests
        are refused from the start of a drain (by `admit`); parts of accepted ones are still run
        until the batcher has stopped.
        """
        if admitted:
            self._admitted -= 1
        if self._stopped:
            raise Unavailable("the model is shutting down")
        if not self.serving:
            raise Unavailable("no model instance is in service (every one is stuck in an overlong run)", "no_instance")
        loop = asyncio.get_running_loop()
        item = WorkItem(tokens, outputs, loop.create_future(), deadline)
        self._pending.append(item)
        metrics.QUEUE_DEPTH.labels(*self._labels).set(len(self._pending))
        self._arrived.set()
        expiry = loop.call_at(deadline, self._expire, item) if deadline is not None else None
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away (client cancelled, or its gRPC deadline passed): leave the queue now.
            expired = deadline is not None and deadline - DEADLINE_CLOCK_SLACK_S <= time.monotonic()
            self._leave(item, "expired" if expired else "cancelled")
            raise
        finally:
            if expiry is not None:
                expiry.cancel()

    def _expire(self, item: WorkItem) -> None:
        """A queued request's deadline passed: it leaves the queue with DEADLINE_EXCEEDED.

        Its caller may have gone away in the same loop iteration (gRPC cancels at its own clock's
        deadline): the future is then already cancelled, and `submit` counts the request.
        """
        if not item.future.done() and self._leave(item, "expired"):
            item.future.set_exception(DeadlineExceeded("the request's timeout passed while it was queued"))

    def _leave(self, item: WorkItem, reason: str) -> bool:
        """Remove a still-queued request, counting why; False if it already left (running or answered)."""
        try:
            self._pending.remove(item)
        except ValueError:
            return False
        metrics.DROPPED.labels(*self._labels, reason).inc()
        metrics.QUEUE_DEPTH.labels(*self._labels).set(len(self._pending))
        return True

    async def close(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running batches finish (up to timeout_s), then stop."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)
        self._stopped = True
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
        length = self.policy.padded_length(max(item.length for item in items))
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
        loop = asyncio.get_running_loop()
        watchdog = loop.call_later(self.policy.max_batch_run_s, self._overran, runner, items, submitted)
        try:
            results = await submitted.results
        except Exception as error:
            log.exception("model execution failed for a batch of %d requests", len(items))
            self._fail(items, ModelFailure(f"model execution failed: {error}"))
            return
        finally:
            watchdog.cancel()
            if not submitted.overran:
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
        statistics.of(*labels).record_execution(rows, compute_s)
        queue_histogram = metrics.QUEUE_DURATION.labels(*labels)
        for item in items:
            queue_histogram.observe(started - item.enqueued_at)

    def _overran(self, runner: Runner, items: list[WorkItem], submitted: _Submitted) -> None:
        """A run exceeded max_batch_run_s: fail its requests; the instance is out until the run returns."""
        limit = self.policy.max_batch_run_s
        log.error("model instance stuck: a batch of %d requests has run for over %.0f s", len(items), limit)
        self._fail(items, Unavailable(f"the model did not finish this request's batch within {limit:g} s"))
        submitted.overran = True
        self._stuck += 1
        metrics.STUCK_INSTANCES.labels(*self._labels).set(self._stuck)
        if not self.serving:
            self._fail(self._pending, Unavailable("no model instance is in service"))
            self._pending.clear()
            metrics.QUEUE_DEPTH.labels(*self._labels).set(0)
            if self.on_serving_change is not None:
                self.on_serving_change(False)
        submitted.results.add_done_callback(lambda _: self._returned(runner))

    def _returned(self, runner: Runner) -> None:
        """A stuck run finally returned: its instance is back in service."""
        was_serving = self.serving
        self._stuck -= 1
        metrics.STUCK_INSTANCES.labels(*self._labels).set(self._stuck)
        log.warning("model instance back in service after an overlong run")
        self._idle.put_nowait(runner)
        if not was_serving and self.on_serving_change is not None:
            self.on_serving_change(True)

    @staticmethod
    def _fail(items: list[WorkItem], error: Exception) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
