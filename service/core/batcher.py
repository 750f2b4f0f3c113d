"""Dynamic batching of rows: one bounded queue per model, dispatched to the model's instances.

Callers `submit` a request's rows (token sequences, or an image tower's images: service.core.rows), admitted
there or refused at once when the queue is full, and await them back, in their own order; `check_room` refuses
early what `submit` would. The queue holds requests, the batches hold rows: whenever a request arrives or an
instance finishes, and an instance is idle, a batch is formed from the waiting rows of the level whose turn it
is (service.core.schedule: priorities, tenants' fair shares) — the longest waiting row of the request that
leads, then the waiting rows nearest its length (earlier turns first among equals), up to `max_batch_size`
rows and `max_batch_tokens` padded tokens (rows x the batch's longest), none of them padded far past its own
length (the policy's padding factor and slack), waiting no longer than `max_queue_delay` after the oldest
request arrived. Each batch is padded to its own longest row.

A request is refused at once when the queue at its priority or above holds `max_queue_size`
requests, `max_queue_rows` rows or `max_queue_tokens` tokens, or when those rows would take longer
than `max_queue_wait_ms` to run at the model's measured rate (service.core.throughput, times the
instances in service): a bulk backlog never refuses a query of a higher priority.

With priorities, the express lane keeps a query from waiting for bulk work: when rows of the
highest priority wait and every instance runs rows of a lower one, they run at once on another
thread over the first instance's session (ONNX Runtime runs concurrent calls of one session),
sharing the CPUs (or GPU) with the bulk run for the short time theirs takes.

Cancelled and expired requests leave the queue at once and their waiting rows never run; rows of
theirs already in a running batch are discarded when it returns. Every batch resolves every one
of its futures, with results or with an error; a run that does not return within
`max_batch_run_s` fails its requests and takes its instance out of service until it does.

This module holds the queue, its one consumer loop and the instances' threads; which rows make a
batch is `service.core.policy`'s choice, how they are padded and handed back `service.core.layout`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.core.layout import Group, feed_shape, padded_feed, place_outputs, request_outputs
from service.core.policy import SELECTION_WINDOW_BATCHES, BatchingPolicy, select_rows
from service.core.rows import DEFAULT_SHARE, Done, Rows, Share, WorkItem, WorkResult
from service.core.schedule import RunQueue
from service.core.throughput import Throughput
from service.errors import DeadlineExceeded, InvalidArgument, ModelFailure, Overloaded, Unavailable, past_deadline
from service.ops import metrics, statistics, tracing
from service.ops.metrics import ModelLabels

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext

log = logging.getLogger(__name__)

EXECUTION_FAILED = "model execution failed for this request's batch; see the server log"
"""What a client is told when its batch fails: the cause (paths, library internals) goes to the log only."""


class Runner(Protocol):
    """A model instance: runs one padded batch, blocking, and returns the named outputs."""

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Run a batch."""
        ...


@dataclass(eq=False)
class _Batch:
    """Rows handed to one model instance together: the padded feed, when it started, its watchdog."""

    groups: list[Group]
    instance: _Instance
    feed: dict[str, np.ndarray]
    started: float
    real_tokens: int
    watchdog: asyncio.TimerHandle | None = None
    span: Span | None = None
    """The batch's trace span, while tracing is on and a request in it is sampled."""
    overran: bool = False
    """Set when the run exceeded max_batch_run_s (its requests were failed, its instance retired)."""

    @property
    def priority(self) -> int:
        """The priority of its rows (a batch holds one level's)."""
        return self.groups[0].item.share.priority


Finished = Callable[[_Batch, "dict[str, np.ndarray] | None", "Exception | None"], None]


class _Instance:
    """A model instance and the thread that runs its batches, one at a time.

    The thread hands each finished batch back to the event loop with one `call_soon_threadsafe`:
    no executor, future or task per batch.
    """

    def __init__(
        self, runner: Runner, name: str, loop: asyncio.AbstractEventLoop, finished: Finished, *, express: bool = False
    ) -> None:
        self.runner = runner
        self.express = express
        """The express lane: another thread over the first instance's runner, for the highest priority only."""
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
        self._statistics = statistics.TABLES.of(*self._labels, policy.max_batch_size)
        self._output_names = output_names
        self._runners = list(runners)
        self._pending = RunQueue(policy.priority_levels, policy.min_lower_priority_share, self._labels)
        """Requests with rows waiting for a batch, by priority level and turn."""
        self._reported_pending = 0
        """How many of them the model's statistics count (`_count_pending`)."""
        self._throughput = Throughput()
        """The model's recent rates (rows and tokens per second of run), for how long the queue takes to clear."""
        self._idle: list[_Instance] = []
        self._instances: list[_Instance] = []
        self._express: _Instance | None = None
        self._express_busy = False
        self._running: set[_Batch] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatch_scheduled = False
        self._delay_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._flushing = False
        """Draining: queued rows run at once, without waiting for fuller batches."""
        self._stopped = False
        self._stuck = 0
        self.on_serving_change: Callable[[bool], None] | None = None
        """Told False when every instance is stuck, True when one comes back."""
        metrics.QUEUE_CAPACITY.labels(*self._labels).set(policy.max_queue_size)
        metrics.STUCK_INSTANCES.labels(*self._labels).set(0)

    def start(self) -> None:
        """Start one thread per model instance, answering to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._instances = [
            _Instance(runner, f"model-{self._labels[0]}_{index}", self._loop, self._finished)
            for index, runner in enumerate(self._runners)
        ]
        self._idle = list(self._instances)
        if self.policy.express_lane:
            name = f"model-{self._labels[0]}_express"
            self._express = _Instance(self._runners[0], name, self._loop, self._finished, express=True)

    @property
    def queue_depth(self) -> int:
        """Requests with rows waiting in the queue for a batch."""
        return len(self._pending)

    @property
    def serving(self) -> bool:
        """Whether at least one instance is in service (not stuck in an overlong run)."""
        return self._stuck < len(self._runners)

    def check_room(self, priority: int = 0) -> None:
        """Refuse at once (ServiceError) a new request now: closing, no instance in service, or the queue full.

        `priority`: the request's level (0: the lowest, which every queued row is ahead of).
        """
        if self._closing:
            raise Unavailable("the model is shutting down")
        self._check_capacity(priority or self.policy.priority_levels)

    def _check_capacity(self, priority: int) -> None:
        if not self.serving:
            raise Unavailable("no model instance is in service (every one is stuck in an overlong run)", "no_instance")
        requests, rows, tokens = self._pending.ahead(priority)
        policy = self.policy
        at = f" at priority {priority} or higher" if policy.priority_levels > 1 else ""
        for held, bound, what, setting in (
            (requests, policy.max_queue_size, "requests", "--max-queue-size"),
            (rows, policy.max_queue_rows, "rows", "--max-queue-rows"),
            (tokens, policy.max_queue_tokens, "tokens", "--max-queue-tokens"),
        ):
            if bound and held >= bound:
                raise self._queue_full(f"{held} {what} waiting{at} ({setting} {bound})", tokens)
        if policy.max_queue_wait_ms and rows:
            rows_per_s = self._throughput.rows_per_s * self._in_service
            wait_ms = math.ceil(rows * 1000 / rows_per_s) if rows_per_s else 0
            if wait_ms > policy.max_queue_wait_ms:
                raise self._queue_full(
                    f"{rows} rows waiting{at}, an expected wait of {wait_ms} ms at {rows_per_s:.4g} rows/s"
                    f" (--max-queue-wait-ms {policy.max_queue_wait_ms})",
                    tokens,
                )

    @property
    def _in_service(self) -> int:
        """Instances in service: each runs batches at the measured rate, side by side."""
        return len(self._runners) - self._stuck

    def _queue_full(self, what: str, tokens_ahead: int) -> Overloaded:
        """The refusal of a full queue, with the seconds the tokens ahead take at the model's recent rate."""
        tokens_per_s = self._throughput.tokens_per_s * self._in_service
        retry_after_s = max(1, math.ceil(tokens_ahead / tokens_per_s)) if tokens_per_s else 1
        return Overloaded(f"queue full: {what}; retry in {retry_after_s} s", "queue_full", retry_after_s)

    def enqueue(
        self,
        rows: Rows,
        outputs: tuple[str, ...],
        deadline: float | None,
        on_done: Done | None = None,
        *,
        trace: SpanContext | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> WorkItem:
        """Admit a request's rows into the queue, or refuse them (no instance in service, queue full, stopped).

        The one admission point: a closing batcher still takes the rows of requests accepted before it
        began to close (their callers were told nothing else), until it stops. `on_done` is told the
        WorkResult once all rows are back, or the error; without it the item has a `future` to await
        instead. A caller that goes away calls `cancel`. `trace`: the request's span context, for its
        batches' spans. `share`: its priority and tenant (service.core.schedule).
        """
        if not 1 <= share.priority <= self.policy.priority_levels:
            raise InvalidArgument(
                f"priority {share.priority} is not a level of this model (1, the highest, to"
                f" {self.policy.priority_levels})"
            )
        self._check_capacity(share.priority)
        if self._stopped:
            raise Unavailable("the model is shutting down")
        loop = self._loop
        future = None if on_done is not None else loop.create_future()
        item = WorkItem(rows, outputs, future, deadline, trace, share=share)
        item.on_done = on_done
        self._pending.add(item)
        self._count_pending()
        if not self._dispatch_scheduled:
            # After the callbacks ready now: requests arriving in the same loop step batch together.
            self._dispatch_scheduled = True
            loop.call_soon(self._dispatch)
        if deadline is not None:
            item.expiry = loop.call_at(deadline, self._expire, item)
        return item

    def cancel(self, item: WorkItem) -> None:
        """The caller went away (client cancelled, or its deadline passed): its waiting rows leave the queue now."""
        self._leave(item, "expired" if past_deadline(item.deadline) else "cancelled")
        item.cancel()

    async def submit(
        self,
        rows: Rows,
        outputs: tuple[str, ...],
        deadline: float | None,
        trace: SpanContext | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> WorkResult:
        """Queue a request's rows and wait for all of them (see `enqueue`)."""
        item = self.enqueue(rows, outputs, deadline, trace=trace, share=share)
        try:
            return await item.future
        except asyncio.CancelledError:
            self.cancel(item)
            raise

    def _expire(self, item: WorkItem) -> None:
        """A request's deadline passed with rows still waiting: it leaves the queue with DEADLINE_EXCEEDED.

        Its caller may have gone away in the same loop iteration (gRPC cancels at its own clock's
        deadline): the future is then already cancelled, and `submit` counts the request.
        """
        if not item.settled and self._leave(item, "expired"):
            item.resolve(None, DeadlineExceeded("the request's timeout passed while it was queued"))

    def _leave(self, item: WorkItem, reason: str) -> bool:
        """Drop a request's waiting rows, counting why; False if none were waiting (running or answered)."""
        if not self._abandon(item):
            return False
        self._metrics.dropped(reason)
        return True

    def _count_pending(self) -> None:
        """Tell the model's statistics how many requests this queue holds now (a two-tower model has two queues)."""
        waiting = len(self._pending)
        self._statistics.add_pending(waiting - self._reported_pending)
        self._reported_pending = waiting

    def _abandon(self, item: WorkItem) -> bool:
        """Take a request's waiting rows out of the queue; False if none were waiting."""
        if not item.waiting:
            return False
        self._pending.remove(item)
        item.waiting = []
        self._count_pending()
        return True

    async def close(self, timeout_s: float) -> None:
        """Refuse new work (`check_room`), let queued and running requests finish (up to timeout_s), then stop."""
        self._closing = True
        self.flush()
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopped = True
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self._fail(list(self._pending), Unavailable("the server shut down before this request ran"))
        for instance in self._instances:
            instance.stop()
        if self._express is not None:
            self._express.stop()

    def flush(self) -> None:
        """From now on, run queued rows without waiting out max_queue_delay for fuller batches (a drain)."""
        if not self._flushing:
            self._flushing = True
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand batches to idle instances while rows wait, waiting out max_queue_delay for fuller ones."""
        self._dispatch_scheduled = False
        if self._delay_timer is not None:
            self._delay_timer.cancel()
            self._delay_timer = None
        try:
            while (self._idle or self._express_free()) and self._pending and not self._stopped:
                self._drop_dead()
                if not self._pending:
                    return
                if self.policy.max_queue_delay_s > 0 and not self._flushing and not self._full():
                    oldest = min(item.enqueued_at for item in self._pending)
                    wait_s = oldest + self.policy.max_queue_delay_s - time.monotonic()
                    if wait_s > 0:
                        self._delay_timer = self._loop.call_later(wait_s, self._dispatch)
                        return
                if self._idle:
                    leading = self._pending.leading()
                    self._start(self._idle.pop(0), self._take(leading, select_rows(leading, self.policy)))
                elif self._pending.top() and all(batch.priority > 1 for batch in self._running):
                    leading = self._pending.top()
                    self._express_busy = True
                    self._start(self._express, self._take(leading, select_rows(leading, self.policy), beside=True))
                else:
                    return
        except Exception:
            # Never die quietly: fail what is queued and keep serving.
            log.exception("batch formation failed")
            self._fail(list(self._pending), ModelFailure("batch formation failed; see the server log"))

    def _express_free(self) -> bool:
        """Whether the express lane exists and runs nothing now."""
        return self._express is not None and not self._express_busy

    def _take(
        self, leading: list[WorkItem], chosen: list[tuple[WorkItem, int]], *, beside: bool = False
    ) -> list[Group]:
        """Take the chosen rows (of the `leading` requests) out of the queue: each request's rows together, in order.

        The queue then moves on (service.core.schedule): requests left with no waiting rows leave it,
        a leader larger than one batch waits behind its tenant's later requests.
        """
        by_item: dict[WorkItem, list[int]] = {}
        for item, row in chosen:
            by_item.setdefault(item, []).append(row)
        groups, start = [], 0
        for item, rows in by_item.items():
            if len(rows) == len(item.waiting):
                item.waiting = []
            else:
                taken = set(rows)
                item.waiting = [row for row in item.waiting if row not in taken]
            groups.append(Group(item, sorted(rows), start))
            start += len(rows)
        self._pending.taken(leading, by_item, self.policy.max_batch_size, beside=beside)
        self._count_pending()
        return groups

    def _start(self, instance: _Instance, groups: list[Group]) -> None:
        """Pad a batch and hand it to an instance, under a watchdog of max_batch_run_s."""
        try:
            feed, real_tokens = padded_feed(groups, self.policy)
        except Exception:
            log.exception("padding a batch of %d requests failed", len(groups))
            self._fail([group.item for group in groups], ModelFailure(EXECUTION_FAILED))
            self._release(instance)
            return
        batch = _Batch(groups, instance, feed, time.monotonic(), real_tokens)
        if tracing.ON:
            rows, length = feed_shape(feed)
            traces = [group.item.trace for group in groups]
            batch.span = tracing.start_batch(self._labels, traces, rows, rows * length, real_tokens)
        batch.watchdog = self._loop.call_later(self.policy.max_batch_run_s, self._overran, batch)
        self._running.add(batch)
        wanted = {name for group in groups for name in group.item.outputs}
        instance.run(batch, tuple(name for name in self._output_names if name in wanted))

    def _full(self) -> bool:
        """Whether the waiting rows fill a batch (its rows, or its tokens at the longest waiting row, padded)."""
        waiting_rows = self._pending.waiting_rows
        if waiting_rows >= self.policy.max_batch_size:
            return True
        longest = max(item.next_length for item in self._pending)
        return waiting_rows * self.policy.padded_length(longest) >= self.policy.max_batch_tokens

    def _drop_dead(self) -> None:
        """Remove cancelled requests and fail expired ones among those the next batch is chosen from, counting both.

        select_rows reads at most a window's worth of requests (one more: the anchor may add no
        row). Requests further back leave by their own expiry timers and `cancel` calls; this only
        closes the gap until those run, for the requests a batch could take now.
        """
        now = time.monotonic()
        readable = self._pending.leading()[: self.policy.max_batch_size * SELECTION_WINDOW_BATCHES + 1]
        dead = [item for item in readable if item.settled or (item.deadline is not None and item.deadline <= now)]
        for item in dead:
            self._abandon(item)
            if item.settled:
                self._metrics.dropped("cancelled")
            else:
                item.resolve(None, DeadlineExceeded("the request's timeout passed while it was queued"))
                self._metrics.dropped("expired")

    def _finished(self, batch: _Batch, results: dict[str, np.ndarray] | None, error: Exception | None) -> None:
        """A batch came back from its instance (on the loop): restart the instance, then answer its rows."""
        self._running.discard(batch)
        batch.watchdog.cancel()
        if batch.span is not None:
            tracing.end_batch(batch.span, error)
        if batch.overran and not batch.instance.express:
            self._returned(batch.instance)
        else:
            self._release(batch.instance)
        if self._pending:
            self._dispatch()  # the model starts its next batch before this one's answers are handed back
        items = [group.item for group in batch.groups]
        if error is not None:
            log.error("model execution failed for a batch of %d requests", len(items), exc_info=error)
            self._fail(items, ModelFailure(EXECUTION_FAILED))
            return
        try:
            now = time.monotonic()
            compute_s = now - batch.started
            self._record(batch, compute_s)
            rows = feed_shape(batch.feed)[0]
            for group in batch.groups:
                if not group.item.settled:  # a cancelled or failed request's rows are discarded
                    self._answer(group, results, compute_s, rows, now)
        except Exception:  # a fault here fails this batch's requests only
            log.exception("handing back a batch of %d requests failed", len(items))
            self._fail(items, ModelFailure(EXECUTION_FAILED))

    def _answer(
        self, group: Group, results: dict[str, np.ndarray], compute_s: float, batch_rows: int, now: float
    ) -> None:
        """Hand a request its rows from this batch (back at `now`); resolve it once all of its rows are back."""
        item = group.item
        item.compute_s += compute_s
        item.batch_rows = max(item.batch_rows, batch_rows)
        item.unanswered -= len(group.rows)
        if item.unanswered == 0 and item.results is None:  # all of its rows, in its order, in this batch
            outputs = request_outputs(group, results)
        else:
            place_outputs(group, results)
            if item.unanswered:
                return
            outputs = item.results
        total_s = now - item.enqueued_at
        compute_total = min(item.compute_s, total_s)
        item.resolve(WorkResult(outputs, total_s - compute_total, compute_total, item.batch_rows))

    def _record(self, batch: _Batch, compute_s: float) -> None:
        rows, length = feed_shape(batch.feed)
        model_metrics = self._metrics
        for group in batch.groups:
            model_metrics.ran(group.item.share.priority, group.item.share.tenant, len(group.rows))
        model_metrics.compute_duration.observe(compute_s)
        model_metrics.batch_size.observe(rows)
        model_metrics.padding_ratio.observe(1.0 - batch.real_tokens / (rows * length))
        model_metrics.sequences.inc(rows)
        model_metrics.tokens.inc(batch.real_tokens)
        self._throughput.record(rows, batch.real_tokens, compute_s)
        self._statistics.record_execution(rows, compute_s)

    def _release(self, instance: _Instance) -> None:
        """An instance (or the express lane) is free for the next batch."""
        if instance.express:
            self._express_busy = False
        else:
            self._idle.append(instance)

    def _overran(self, batch: _Batch) -> None:
        """A run exceeded max_batch_run_s: fail its requests; the instance is out until the run returns.

        The express lane, stuck, only stays busy until its run returns: it is no instance of its own.
        """
        limit = self.policy.max_batch_run_s
        items = [group.item for group in batch.groups]
        log.error("model instance stuck: a batch of %d requests has run for over %.0f s", len(items), limit)
        self._fail(items, Unavailable(f"the model did not finish this request's batch within {limit:g} s"))
        batch.overran = True
        if batch.instance.express:
            return
        self._stuck += 1
        metrics.STUCK_INSTANCES.labels(*self._labels).set(self._stuck)
        if not self.serving:
            self._fail(list(self._pending), Unavailable("no model instance is in service"))
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

    def _fail(self, items: list[WorkItem], error: Exception) -> None:
        """Fail requests: their waiting rows leave the queue, their running ones will be discarded."""
        for item in items:
            self._abandon(item)
            if not item.settled:
                item.resolve(None, error)
