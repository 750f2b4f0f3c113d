"""Dynamic batching: one bounded queue per model, dispatched to its model instances.

Callers `admit` a request (rejected at once when the queue is full), then `submit` its token
arrays and await their own rows back. Whenever a request arrives or an instance finishes, and an
instance is idle, a batch is formed: the oldest request plus the queued requests closest to its
length, up to `max_batch_size` rows and `max_batch_tokens` padded tokens, waiting no longer than
`max_queue_delay` after the oldest arrived. Cancelled and expired requests leave the queue at
once and never run. Every batch resolves every one of its futures, with results or with an
error; a run that does not return within `max_batch_run_s` fails its requests and takes its
instance out of service until it does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service import metrics, statistics
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, Unavailable, past_deadline
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


@dataclass(eq=False)
class _Batch:
    """Requests handed to one model instance together: the padded feed, when it started, its watchdog."""

    items: list[WorkItem]
    instance: _Instance
    feed: dict[str, np.ndarray]
    started: float
    watchdog: asyncio.TimerHandle | None = None
    overran: bool = False
    """Set when the run exceeded max_batch_run_s (its requests were failed, its instance retired)."""


Finished = Callable[[_Batch, "dict[str, np.ndarray] | None", "Exception | None"], None]


class _Instance:
    """A model instance and the thread that runs its batches, one at a time.

    The thread hands each finished batch back to the event loop with one `call_soon_threadsafe`:
    no executor, future or task per batch.
    """

    def __init__(self, runner: Runner, name: str, loop: asyncio.AbstractEventLoop, finished: Finished) -> None:
        self.runner = runner
        self._loop = loop
        self._finished = finished
        self._inbox: queue.SimpleQueue[tuple[_Batch, tuple[str, ...]] | None] = queue.SimpleQueue()
        # A daemon: a run that never returns must not keep the process from exiting.
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def run(self, batch: _Batch, outputs: tuple[str, ...]) -> None:
        """Queue a batch for this instance's thread."""
        self._inbox.put((batch, outputs))

    def stop(self) -> None:
        """End the thread once its current run (if any) returns."""
        self._inbox.put(None)

    def _serve(self) -> None:
        while (job := self._inbox.get()) is not None:
            batch, outputs = job
            results, error = None, None
            try:
                results = self.runner.run(batch.feed, outputs)
            except Exception as raised:  # handed to the loop, which fails this batch's requests
                error = raised
            try:
                self._loop.call_soon_threadsafe(self._finished, batch, results, error)
            except RuntimeError:  # the loop closed while this batch ran: nobody waits for it
                return


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
    """The queue of one model and the dispatching of its batches to the model's instances."""

    def __init__(
        self,
        runners: Sequence[Runner],
        policy: BatchingPolicy,
        labels: ModelLabels,
        output_names: tuple[str, ...],
    ) -> None:
        self.policy = policy
        self._labels = labels.values()
        self._metrics = metrics.of(labels)
        self._statistics = statistics.of(*self._labels)
        self._output_names = output_names
        self._runners = list(runners)
        self._pending: list[WorkItem] = []
        self._idle: list[_Instance] = []
        self._instances: list[_Instance] = []
        self._running: set[_Batch] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatch_scheduled = False
        self._delay_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._stopped = False
        self._admitted = 0
        """Requests admitted and not yet queued (being tokenised): they hold a queue place."""
        self._stuck = 0
        self.on_serving_change: Callable[[bool], None] | None = None
        """Told False when every instance is stuck, True when one comes back."""
        metrics.QUEUE_CAPACITY.labels(*self._labels).set(policy.max_queue_size)
        metrics.QUEUE_DEPTH.labels(*self._labels).set_function(lambda: self.queue_depth)
        metrics.STUCK_INSTANCES.labels(*self._labels).set(0)

    def start(self) -> None:
        """Start one thread per model instance, answering to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._instances = [
            _Instance(runner, f"model-{self._labels[0]}_{index}", self._loop, self._finished)
            for index, runner in enumerate(self._runners)
        ]
        self._idle = list(self._instances)

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue for a batch."""
        return len(self._pending)

    @property
    def serving(self) -> bool:
        """Whether at least one instance is in service (not stuck in an overlong run)."""
        return self._stuck < len(self._runners)

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
        loop = self._loop
        item = WorkItem(tokens, outputs, loop.create_future(), deadline)
        self._pending.append(item)
        if not self._dispatch_scheduled:
            # After the callbacks ready now: requests arriving in the same loop step batch together.
            self._dispatch_scheduled = True
            loop.call_soon(self._dispatch)
        expiry = loop.call_at(deadline, self._expire, item) if deadline is not None else None
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away (client cancelled, or its gRPC deadline passed): leave the queue now.
            expired = past_deadline(deadline)
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
        self._metrics.dropped(reason)
        return True

    async def close(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running batches finish (up to timeout_s), then stop."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopped = True
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self._fail(self._pending, Unavailable("the server shut down before this request ran"))
        self._pending.clear()
        for instance in self._instances:
            instance.stop()

    def _dispatch(self) -> None:
        """Hand batches to idle instances while work is queued, waiting out max_queue_delay for fuller ones."""
        self._dispatch_scheduled = False
        if self._delay_timer is not None:
            self._delay_timer.cancel()
            self._delay_timer = None
        try:
            while self._idle and self._pending and not self._stopped:
                self._drop_dead()
                if not self._pending:
                    return
                if not self._full():
                    wait_s = self._pending[0].enqueued_at + self.policy.max_queue_delay_s - time.monotonic()
                    if wait_s > 0:
                        self._delay_timer = self._loop.call_later(wait_s, self._dispatch)
                        return
                chosen = select_batch(self._pending, self.policy)
                taken = set(map(id, chosen))
                self._pending = [item for item in self._pending if id(item) not in taken]
                self._start(self._idle.pop(0), chosen)
        except Exception:
            # Never die quietly: fail what is queued and keep serving.
            log.exception("batch formation failed")
            self._fail(self._pending, ModelFailure("batch formation failed; see the server log"))
            self._pending.clear()

    def _start(self, instance: _Instance, items: list[WorkItem]) -> None:
        """Pad a batch and hand it to an instance, under a watchdog of max_batch_run_s."""
        try:
            feed = self._pad(items)
        except Exception as error:
            log.exception("padding a batch of %d requests failed", len(items))
            self._fail(items, ModelFailure(f"model execution failed: {error}"))
            self._idle.append(instance)
            return
        batch = _Batch(items, instance, feed, time.monotonic())
        batch.watchdog = self._loop.call_later(self.policy.max_batch_run_s, self._overran, batch)
        self._running.add(batch)
        instance.run(batch, tuple(name for name in self._output_names if any(name in item.outputs for item in items)))

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
                self._metrics.dropped("cancelled")
            elif item.deadline is not None and item.deadline <= now:
                item.future.set_exception(DeadlineExceeded("the request's timeout passed while it was queued"))
                self._metrics.dropped("expired")
            else:
                alive.append(item)
        if len(alive) != len(self._pending):
            self._pending = alive

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

    def _finished(self, batch: _Batch, results: dict[str, np.ndarray] | None, error: Exception | None) -> None:
        """A batch came back from its instance (on the loop): restart the instance, then answer the batch."""
        self._running.discard(batch)
        batch.watchdog.cancel()
        if batch.overran:
            self._returned(batch.instance)
        else:
            self._idle.append(batch.instance)
        if self._pending:
            self._dispatch()  # the model starts its next batch before this one's answers are encoded
        items = batch.items
        if error is not None:
            log.error("model execution failed for a batch of %d requests", len(items), exc_info=error)
            self._fail(items, ModelFailure(f"model execution failed: {error}"))
            return
        compute_s = time.monotonic() - batch.started
        feed, started = batch.feed, batch.started
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
        real_tokens = int(np.count_nonzero(feed["attention_mask"]))
        model_metrics = self._metrics
        model_metrics.compute_duration.observe(compute_s)
        model_metrics.batch_size.observe(rows)
        model_metrics.padding_ratio.observe(1.0 - real_tokens / (rows * length))
        model_metrics.sequences.inc(rows)
        model_metrics.tokens.inc(real_tokens)
        self._statistics.record_execution(rows, compute_s)
        queue_histogram = model_metrics.queue_duration
        for item in items:
            queue_histogram.observe(started - item.enqueued_at)

    def _overran(self, batch: _Batch) -> None:
        """A run exceeded max_batch_run_s: fail its requests; the instance is out until the run returns."""
        limit = self.policy.max_batch_run_s
        log.error("model instance stuck: a batch of %d requests has run for over %.0f s", len(batch.items), limit)
        self._fail(batch.items, Unavailable(f"the model did not finish this request's batch within {limit:g} s"))
        batch.overran = True
        self._stuck += 1
        metrics.STUCK_INSTANCES.labels(*self._labels).set(self._stuck)
        if not self.serving:
            self._fail(self._pending, Unavailable("no model instance is in service"))
            self._pending.clear()
            if self.on_serving_change is not None:
                self.on_serving_change(False)

    def _returned(self, instance: _Instance) -> None:
        """A stuck run finally returned: its instance is back in service."""
        was_serving = self.serving
        self._stuck -= 1
        metrics.STUCK_INSTANCES.labels(*self._labels).set(self._stuck)
        log.warning("model instance back in service after an overlong run")
        self._idle.append(instance)
        if not was_serving and self.on_serving_change is not None:
            self.on_serving_change(True)

    @staticmethod
    def _fail(items: list[WorkItem], error: Exception) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
