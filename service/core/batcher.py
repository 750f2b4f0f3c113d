"""Dynamic batching of rows: one bounded queue per model, dispatched to the model's instances.

Callers `admit` a request (refused at once when the queue is full), then `submit` its token rows
and await them back, in their own order. The queue holds requests, the batches hold rows: whenever
a request arrives or an instance finishes, and an instance is idle, a batch is formed from the
waiting rows of every queued request — the longest waiting row of the request at the head of the
queue, then the waiting rows nearest its length (older requests first among equals), up to
`max_batch_size` rows and `max_batch_tokens` padded tokens (rows x the batch's longest), none of
them padded far past its own length (the policy's padding factor and slack), waiting no longer than
`max_queue_delay` after the oldest request arrived. Each batch is padded to its own longest row.
A request larger than one batch (over `max_batch_size` rows) goes to the back of the queue after
each batch it leads, so it is spread over batches by length while others are served between them;
smaller requests lead in the order they came.

Cancelled and expired requests leave the queue at once and their waiting rows never run; rows of
theirs already in a running batch are discarded when it returns. Every batch resolves every one
of its futures, with results or with an error; a run that does not return within
`max_batch_run_s` fails its requests and takes its instance out of service until it does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from service.core.rows import TokenRows
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, Unavailable, past_deadline
from service.ops import metrics, statistics, tracing
from service.ops.metrics import ModelLabels

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext

log = logging.getLogger(__name__)

EXECUTION_FAILED = "model execution failed for this request's batch; see the server log"
"""What a client is told when its batch fails: the cause (paths, library internals) goes to the log only."""
SELECTION_WINDOW_BATCHES = 2
"""A batch is chosen among the waiting rows of the queue's first requests, up to this many batches' worth."""


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
    """Padded tokens (rows x longest) per batch; a single row may exceed it alone."""
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
    max_padding_factor: float = 2.0
    padding_slack_tokens: int = 32
    """No row of a batch is padded past the larger of max_padding_factor times the (bucketed) length it
    would have alone and that length plus padding_slack_tokens.

    A padded encoder's cost grows with rows x padded length: [40, 60, 200] padded to 200 costs 600
    tokens where [40, 60] at 60 and [200] alone cost 320. Short rows batch together whatever their
    lengths: a batch also has a fixed cost (each operator's start, threads waking), which a few tokens
    of padding cost less than. With length buckets (CUDA), rows in one bucket batch together freely."""

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest row is `longest` is padded to: bucketed, capped at max_length."""
        bucketed = -(-longest // self.length_bucket) * self.length_bucket
        return min(bucketed, max(self.max_length, longest)) if self.max_length else bucketed


class WorkResult(msgspec.Struct, gc=False):
    """A request's own rows of each requested output, in its order, and where its time went.

    A msgspec Struct: built in C, at a third of a dataclass's cost (one per request on the loop).
    """

    outputs: dict[str, np.ndarray]
    queue_s: float
    """Time in the batcher not spent running its batches."""
    compute_s: float
    """Run time of the batches its rows rode in."""
    batch_rows: int
    """Rows of the largest batch it rode in."""


Done = Callable[["WorkItem", "WorkResult | None", "Exception | None"], None]
"""Told a settled request: its result, or its error."""


class WorkItem:
    """One queued request: its token rows, those still waiting for a batch, and who is told when it settles."""

    __slots__ = (
        "_settled",
        "batch_rows",
        "compute_s",
        "deadline",
        "enqueued_at",
        "expiry",
        "future",
        "lengths",
        "on_done",
        "outputs",
        "owner",
        "results",
        "rows",
        "starts",
        "trace",
        "unanswered",
        "waiting",
    )

    def __init__(
        self,
        rows: TokenRows,
        outputs: tuple[str, ...],
        future: asyncio.Future[WorkResult] | None,
        deadline: float | None,
        trace: SpanContext | None = None,
    ) -> None:
        self.rows = rows
        self.trace = trace
        """The request's span context (while tracing is on): its batches' spans link to it."""
        self.outputs = outputs
        self.future = future
        """What an awaiting caller waits on (None for callers told by `on_done`)."""
        self._settled = False
        self.deadline = deadline
        self.enqueued_at = time.monotonic()
        self.lengths: list[int] = rows.lengths.tolist()
        self.waiting: list[int]
        """Rows not yet in a batch, shortest first (the longest is taken next)."""
        if len(self.lengths) == 1:  # most requests: one text
            self.starts: list[int] = [0]
            self.waiting = [0]
        else:
            self.starts = [0, *itertools.accumulate(self.lengths[:-1])]
            self.waiting = np.argsort(rows.lengths, kind="stable").tolist()
        self.unanswered = len(self.lengths)
        """Rows not yet back from a run."""
        self.results: dict[str, np.ndarray] | None = None
        """The outputs being filled in, once rows come back from more than one batch."""
        self.compute_s = 0.0
        self.batch_rows = 0
        self.expiry: asyncio.TimerHandle | None = None
        """The timer that fails the request at its deadline, while it has rows waiting."""
        self.on_done: Done | None = None
        """Told (on the loop, at once) the result or error the request is settled with; None: await `future`."""
        self.owner: object = None
        """The caller's own note of whose request this is (the batcher never reads it)."""

    def resolve(self, result: WorkResult | None, error: Exception | None = None) -> None:
        """Settle the request: its result or its error; its expiry timer, its future and `on_done` follow."""
        self._settled = True
        if self.expiry is not None:
            self.expiry.cancel()
        if self.future is not None:
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        if self.on_done is not None:
            self.on_done(self, result, error)

    @property
    def settled(self) -> bool:
        """Answered, failed or cancelled (its awaiting caller gone counts): its rows are never answered again."""
        return self._settled or (self.future is not None and self.future.done())

    def cancel(self) -> None:
        """The caller went away: settled, without an answer."""
        self._settled = True
        if self.expiry is not None:
            self.expiry.cancel()
        if self.future is not None:
            self.future.cancel()

    @property
    def next_length(self) -> int:
        """Length of the longest waiting row."""
        return self.lengths[self.waiting[-1]]


class _Group(msgspec.Struct, eq=False, gc=False):
    """One request's rows in a batch: which rows (ascending), from which position of the batch."""

    item: WorkItem
    rows: list[int]
    start: int


@dataclass(eq=False)
class _Batch:
    """Rows handed to one model instance together: the padded feed, when it started, its watchdog."""

    groups: list[_Group]
    instance: _Instance
    feed: dict[str, np.ndarray]
    started: float
    real_tokens: int
    watchdog: asyncio.TimerHandle | None = None
    span: Span | None = None
    """The batch's trace span, while tracing is on and a request in it is sampled."""
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


def select_rows(pending: Sequence[WorkItem], policy: BatchingPolicy) -> list[tuple[WorkItem, int]]:
    """The first request's longest waiting row, then the waiting rows nearest its length that fit both budgets.

    Rows are considered from the queue's first requests, up to SELECTION_WINDOW_BATCHES batches'
    worth; among rows equally near, older requests' come first.
    """
    anchor = pending[0]
    anchor_row = anchor.waiting[-1]
    target = anchor.lengths[anchor_row]
    window = policy.max_batch_size * SELECTION_WINDOW_BATCHES
    enough_exact = policy.max_batch_size - 1
    candidates: list[tuple[int, int, WorkItem, int]] = []
    exact = 0  # candidates of the anchor's length: once they fill the batch, no later row comes before them
    for item in pending:
        rows = item.waiting[:-1] if item is anchor else item.waiting
        if len(rows) == 1:  # most requests: one text
            distance = abs(item.lengths[rows[0]] - target)
            exact += distance == 0
            candidates.append((distance, len(candidates), item, rows[0]))
        else:
            lengths, first = item.lengths, len(candidates)
            candidates += [(abs(lengths[row] - target), first + i, item, row) for i, row in enumerate(rows)]
            exact += sum(lengths[row] == target for row in rows)
        if len(candidates) >= window or exact >= enough_exact:
            break
    candidates.sort()  # by distance, then age: (distance, order) never ties, so items are never compared
    chosen = [(anchor, anchor_row)]
    shortest = longest = target
    max_rows, max_tokens, padded_length = policy.max_batch_size, policy.max_batch_tokens, policy.padded_length
    padded_longest = padded_length(longest)
    for _, _, item, row in candidates:
        if len(chosen) >= max_rows:
            break
        length = item.lengths[row]
        if length <= longest and length >= shortest:  # within the batch's range: it pads to the same length
            if (len(chosen) + 1) * padded_longest > max_tokens:
                break  # every later candidate needs at least as many tokens as this one
            chosen.append((item, row))
            continue
        wider, narrower = max(longest, length), min(shortest, length)
        padded = padded_length(wider)
        if (len(chosen) + 1) * padded > max_tokens:
            if length <= longest:
                break  # every later candidate needs at least as many tokens as this one
            continue
        own = padded_length(narrower)
        if padded > max(policy.max_padding_factor * own, own + policy.padding_slack_tokens):
            continue  # cheaper in a batch of its own length than padded this far
        chosen.append((item, row))
        shortest, longest, padded_longest = narrower, wider, padded
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
        self._statistics = statistics.TABLES.of(*self._labels, policy.max_batch_size)
        self._output_names = output_names
        self._runners = list(runners)
        self._pending: list[WorkItem] = []
        """Requests with rows waiting for a batch, in the order they get to lead one."""
        self._waiting_rows = 0
        self._idle: list[_Instance] = []
        self._instances: list[_Instance] = []
        self._running: set[_Batch] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatch_scheduled = False
        self._delay_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._flushing = False
        """Draining: queued rows run at once, without waiting for fuller batches."""
        self._stopped = False
        self._admitted = 0
        """Requests admitted and not yet queued (being tokenised): they hold a queue place."""
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

    @property
    def queue_depth(self) -> int:
        """Requests with rows waiting in the queue for a batch."""
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
        self.check_room()
        self._admitted += 1

    def check_room(self) -> None:
        """Refuse at once (ServiceError) what `admit` would refuse now; takes no place."""
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

    def withdraw(self) -> None:
        """Give back the place of an admitted request that will not be submitted."""
        self._admitted -= 1

    def enqueue(
        self,
        rows: TokenRows,
        outputs: tuple[str, ...],
        deadline: float | None,
        admitted: bool = False,
        on_done: Done | None = None,
        *,
        trace: SpanContext | None = None,
    ) -> WorkItem:
        """Queue a request's rows; `on_done` is told its WorkResult once all of them are back, or its error.

        `admitted`: its place was taken by `admit` (and is handed over here); otherwise it is
        admitted now, or refused. Without `on_done` the item has a `future` to await instead.
        A caller that goes away calls `cancel`. `trace`: the request's span context, for its batches' spans.
        """
        if admitted:
            self._admitted -= 1
        else:
            self.check_room()
        if self._stopped:
            raise Unavailable("the model is shutting down")
        loop = self._loop
        item = WorkItem(rows, outputs, None if on_done is not None else loop.create_future(), deadline, trace)
        item.on_done = on_done
        self._pending.append(item)
        self._statistics.set_pending(len(self._pending))
        self._waiting_rows += len(item.waiting)
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
        rows: TokenRows,
        outputs: tuple[str, ...],
        deadline: float | None,
        admitted: bool = False,
        trace: SpanContext | None = None,
    ) -> WorkResult:
        """Queue a request's rows and wait for all of them (see `enqueue`)."""
        item = self.enqueue(rows, outputs, deadline, admitted, trace=trace)
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

    def _abandon(self, item: WorkItem) -> bool:
        """Take a request's waiting rows out of the queue; False if none were waiting."""
        if not item.waiting:
            return False
        self._waiting_rows -= len(item.waiting)
        item.waiting = []
        self._pending.remove(item)
        self._statistics.set_pending(len(self._pending))
        return True

    async def close(self, timeout_s: float) -> None:
        """Refuse new work, let admitted, queued and running requests finish (up to timeout_s), then stop.

        Admitted requests not yet queued (being tokenised) are accepted work: the drain waits for them too.
        """
        self._closing = True
        self.flush()
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._running or self._admitted) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopped = True
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self._fail(list(self._pending), Unavailable("the server shut down before this request ran"))
        for instance in self._instances:
            instance.stop()

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
            while self._idle and self._pending and not self._stopped:
                self._drop_dead()
                if not self._pending:
                    return
                if self.policy.max_queue_delay_s > 0 and not self._flushing and not self._full():
                    oldest = min(item.enqueued_at for item in self._pending)
                    wait_s = oldest + self.policy.max_queue_delay_s - time.monotonic()
                    if wait_s > 0:
                        self._delay_timer = self._loop.call_later(wait_s, self._dispatch)
                        return
                self._start(self._idle.pop(0), self._take(select_rows(self._pending, self.policy)))
        except Exception:
            # Never die quietly: fail what is queued and keep serving.
            log.exception("batch formation failed")
            self._fail(list(self._pending), ModelFailure("batch formation failed; see the server log"))

    def _take(self, chosen: list[tuple[WorkItem, int]]) -> list[_Group]:
        """Take the chosen rows out of the queue: each request's rows together, in its order.

        A leading request larger than one batch (more than max_batch_size rows) goes to the back of
        the queue if it still has rows waiting; a smaller one keeps its place, so requests finish
        in the order they came. Requests left with no waiting rows leave the queue.
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
            rows.sort()
            groups.append(_Group(item, rows, start))
            start += len(rows)
        self._waiting_rows -= start
        leader = self._pending[0]
        if leader.waiting and len(leader.lengths) > self.policy.max_batch_size:
            # More than a batch's worth of rows: the rest waits its turn behind the requests queued after it.
            self._pending = [item for item in self._pending if item.waiting and item is not leader]
            self._pending.append(leader)
        else:
            self._pending = [item for item in self._pending if item.waiting]
        self._statistics.set_pending(len(self._pending))
        return groups

    def _start(self, instance: _Instance, groups: list[_Group]) -> None:
        """Pad a batch and hand it to an instance, under a watchdog of max_batch_run_s."""
        try:
            feed, real_tokens = self._pad(groups)
        except Exception:
            log.exception("padding a batch of %d requests failed", len(groups))
            self._fail([group.item for group in groups], ModelFailure(EXECUTION_FAILED))
            self._idle.append(instance)
            return
        batch = _Batch(groups, instance, feed, time.monotonic(), real_tokens)
        if tracing.ON:
            rows, length = feed["input_ids"].shape
            traces = [group.item.trace for group in groups]
            batch.span = tracing.start_batch(self._labels, traces, rows, rows * length, real_tokens)
        batch.watchdog = self._loop.call_later(self.policy.max_batch_run_s, self._overran, batch)
        self._running.add(batch)
        wanted = {name for group in groups for name in group.item.outputs}
        instance.run(batch, tuple(name for name in self._output_names if name in wanted))

    def _full(self) -> bool:
        """Whether the waiting rows fill a batch (its rows, or its tokens at the longest waiting row)."""
        if self._waiting_rows >= self.policy.max_batch_size:
            return True
        longest = max(item.next_length for item in self._pending)
        return self._waiting_rows * longest >= self.policy.max_batch_tokens

    def _drop_dead(self) -> None:
        """Remove cancelled requests and fail expired ones among those the next batch is chosen from, counting both.

        select_rows reads at most a window's worth of requests (one more: the anchor may add no
        row). Requests further back leave by their own expiry timers and `cancel` calls; this only
        closes the gap until those run, for the requests a batch could take now.
        """
        now = time.monotonic()
        readable = self._pending[: self.policy.max_batch_size * SELECTION_WINDOW_BATCHES + 1]
        dead = [item for item in readable if item.settled or (item.deadline is not None and item.deadline <= now)]
        for item in dead:
            self._abandon(item)
            if item.settled:
                self._metrics.dropped("cancelled")
            else:
                item.resolve(None, DeadlineExceeded("the request's timeout passed while it was queued"))
                self._metrics.dropped("expired")

    def _pad(self, groups: list[_Group]) -> tuple[dict[str, np.ndarray], int]:
        """The batch's feed, every row right-padded to the batch's (bucketed) longest; and its real tokens.

        Each array is filled in one step from the rows' tokens laid end to end: the positions kept
        (row by row, up to each row's length) are the same, in the same order, as those tokens.
        """
        ids: list[np.ndarray] = []
        lengths: list[int] = []
        masked = typed = False
        for group in groups:
            item = group.item
            tokens, starts, item_lengths = item.rows, item.starts, item.lengths
            masked = masked or tokens.attention_mask is not None
            typed = typed or tokens.token_type_ids is not None
            if len(item_lengths) == 1:  # most requests: one text, its ids whole
                lengths.append(item_lengths[0])
                ids.append(tokens.input_ids)
                continue
            for row in group.rows:
                start, length = starts[row], item_lengths[row]
                lengths.append(length)
                ids.append(tokens.input_ids[start : start + length])
        shape = (len(lengths), self.policy.padded_length(max(lengths)))
        # Rows that all fill the batch (one text, or equal lengths) need no padding placed.
        kept = None if min(lengths) == shape[1] else np.arange(shape[1]) < np.array(lengths)[:, None]
        feed_ids = _laid_out(ids[0] if len(ids) == 1 else np.concatenate(ids), kept, shape, self.policy.pad_token_id)
        if masked:
            feed_mask = _laid_out(np.concatenate(list(self._each_row(groups, "attention_mask", 1))), kept, shape, 0)
        else:
            feed_mask = np.ones(shape, dtype=np.int64) if kept is None else kept.astype(np.int64)
        if typed:
            feed_types = _laid_out(np.concatenate(list(self._each_row(groups, "token_type_ids", 0))), kept, shape, 0)
        else:
            feed_types = np.zeros(shape, dtype=np.int64)
        real_tokens = int(np.count_nonzero(feed_mask)) if masked else sum(lengths)
        return {"input_ids": feed_ids, "attention_mask": feed_mask, "token_type_ids": feed_types}, real_tokens

    @staticmethod
    def _each_row(groups: list[_Group], name: str, default: int) -> Iterator[np.ndarray]:
        """Each row's values of one optional per-token array, in batch order (`default` where a request has none)."""
        for group in groups:
            item = group.item
            values = getattr(item.rows, name)
            for row in group.rows:
                start, length = item.starts[row], item.lengths[row]
                yield np.full(length, default, np.int64) if values is None else values[start : start + length]

    def _finished(self, batch: _Batch, results: dict[str, np.ndarray] | None, error: Exception | None) -> None:
        """A batch came back from its instance (on the loop): restart the instance, then answer its rows."""
        self._running.discard(batch)
        batch.watchdog.cancel()
        if batch.span is not None:
            tracing.end_batch(batch.span, error)
        if batch.overran:
            self._returned(batch.instance)
        else:
            self._idle.append(batch.instance)
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
            rows = batch.feed["input_ids"].shape[0]
            for group in batch.groups:
                if not group.item.settled:  # a cancelled or failed request's rows are discarded
                    self._answer(group, results, compute_s, rows, now)
        except Exception:  # a fault here fails this batch's requests only
            log.exception("handing back a batch of %d requests failed", len(items))
            self._fail(items, ModelFailure(EXECUTION_FAILED))

    def _answer(
        self, group: _Group, results: dict[str, np.ndarray], compute_s: float, batch_rows: int, now: float
    ) -> None:
        """Hand a request its rows from this batch (back at `now`); resolve it once all of its rows are back."""
        item, count, start = group.item, len(group.rows), group.start
        item.compute_s += compute_s
        item.batch_rows = max(item.batch_rows, batch_rows)
        item.unanswered -= count
        if item.unanswered == 0 and item.results is None:  # all of its rows, in its order, in this batch
            outputs = {}
            for name in item.outputs:
                block = results[name][start : start + count]
                outputs[name] = block if block.ndim == 2 else self._own(block, item, group.rows)
        else:
            if item.results is None:
                item.results = {name: self._empty(results[name], item) for name in item.outputs}
            for name, own in item.results.items():
                block = results[name][start : start + count]
                if own.ndim == 2:
                    own[group.rows] = block
                else:
                    for position, row in enumerate(group.rows):
                        length = item.lengths[row]
                        own[row, :length] = block[position, :length]
            if item.unanswered:
                return
            outputs = item.results
        total_s = now - item.enqueued_at
        compute_total = min(item.compute_s, total_s)
        item.resolve(WorkResult(outputs, total_s - compute_total, compute_total, item.batch_rows))

    @staticmethod
    def _empty(like: np.ndarray, item: WorkItem) -> np.ndarray:
        """A request's output array: per row, or per row and position up to its width (zeros past each row's end)."""
        rows = item.rows.rows
        if like.ndim == 2:
            return np.empty((rows, like.shape[1]), like.dtype)
        return np.zeros((rows, item.rows.width, like.shape[2]), like.dtype)

    @classmethod
    def _own(cls, block: np.ndarray, item: WorkItem, rows: list[int]) -> np.ndarray:
        """A request's whole per-position output from its block of the batch (zeros past each row's end)."""
        width = item.rows.width
        if block.shape[1] >= width and all(length == width for length in item.lengths):
            return block[:, :width]
        own = cls._empty(block, item)
        for position, row in enumerate(rows):
            length = item.lengths[row]
            own[row, :length] = block[position, :length]
        return own

    def _record(self, batch: _Batch, compute_s: float) -> None:
        rows, length = batch.feed["input_ids"].shape
        model_metrics = self._metrics
        model_metrics.compute_duration.observe(compute_s)
        model_metrics.batch_size.observe(rows)
        model_metrics.padding_ratio.observe(1.0 - batch.real_tokens / (rows * length))
        model_metrics.sequences.inc(rows)
        model_metrics.tokens.inc(batch.real_tokens)
        self._statistics.record_execution(rows, compute_s)

    def _overran(self, batch: _Batch) -> None:
        """A run exceeded max_batch_run_s: fail its requests; the instance is out until the run returns."""
        limit = self.policy.max_batch_run_s
        items = [group.item for group in batch.groups]
        log.error("model instance stuck: a batch of %d requests has run for over %.0f s", len(items), limit)
        self._fail(items, Unavailable(f"the model did not finish this request's batch within {limit:g} s"))
        batch.overran = True
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


def _laid_out(tokens: np.ndarray, kept: np.ndarray | None, shape: tuple[int, int], fill: int) -> np.ndarray:
    """Rows' values laid end to end, as a [rows, length] array: `fill` where `kept` is False (None: kept everywhere)."""
    if kept is None:
        return tokens.reshape(shape)
    array = np.full(shape, fill, dtype=np.int64)
    array[kept] = tokens
    return array
