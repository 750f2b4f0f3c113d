"""The batcher in plain asyncio with a fake backend whose answers identify each row.

A test that needs the model busy holds the fake runner on an event and waits until it has
started; a test that needs requests queued waits until the queue-depth gauge says so. Nothing
waits on a clock, so the tests mean the same on a loaded machine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import REGISTRY

from service.core.batcher import EXECUTION_FAILED, Batcher
from service.core.policy import BatchingPolicy, select_rows
from service.core.rows import TokenRows, WorkItem, WorkResult
from service.errors import DEADLINE_CLOCK_SLACK_S, DeadlineExceeded, ModelFailure, Overloaded, Unavailable
from service.ops.metrics import ModelLabels

OUTPUTS = ("last_hidden_state", "embedding")
HOLD_S = 30
"""A held runner gives up waiting after this long; only reached when a test is already failing."""
WAIT_S = 10
"""Bounds the wait for a state that should come; never what a test asserts."""


class FakeRunner:
    """Embedding = (sum of real ids, real length); hidden state echoes ids. Records every batch.

    `release` cleared holds every run until it is set again; `running` is set once a run has started.
    """

    def __init__(self, fail_when_id: int | None = None) -> None:
        self.batches: list[tuple[int, int]] = []
        self.fail_when_id = fail_when_id
        self.release = threading.Event()
        self.release.set()
        self.running = threading.Event()

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        self.running.set()
        self.release.wait(HOLD_S)
        ids, mask = feed["input_ids"], feed["attention_mask"]
        self.batches.append(ids.shape)
        if self.fail_when_id is not None and (ids == self.fail_when_id).any():
            raise RuntimeError("fake model failure")
        embedding = np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1).astype(np.float32)
        hidden = np.repeat(ids[:, :, None], 2, axis=2).astype(np.float32)
        produced = {"embedding": embedding, "last_hidden_state": hidden}
        return {name: produced[name] for name in outputs}

    async def started(self) -> None:
        """Wait until a run has started (the runner is then busy while held)."""
        assert await asyncio.to_thread(self.running.wait, WAIT_S), "the runner never started a batch"


def tokens(ids: list[list[int]]) -> TokenRows:
    """Rows of ids, right-padded with 0 to the longest (0 stands for padding, which the codec drops)."""
    width = max(map(len, ids))
    array = np.array([row + [0] * (width - len(row)) for row in ids], dtype=np.int64)
    return TokenRows.from_padded({"input_ids": array, "attention_mask": (array != 0).astype(np.int64)})


def policy(**changes: float) -> BatchingPolicy:
    values = {"max_batch_size": 8, "max_batch_tokens": 1000, "max_queue_delay_s": 0.02, "max_queue_size": 100}
    return BatchingPolicy(**{**values, **changes})


async def make_batcher(name: str, runners: list[FakeRunner], **changes: float) -> Batcher:
    """A started batcher whose metrics carry its own model label, so counts start at zero."""
    batcher = Batcher(runners, policy(**changes), ModelLabels(name, "1"), OUTPUTS)
    batcher.start()
    return batcher


def metric(name: str, model: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": model, "version": "1", **labels}) or 0.0


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop run until `condition` holds."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


async def queued(model: str, depth: int) -> None:
    await until(lambda: metric("encoder_queue_depth", model) == depth, f"{depth} requests queued")


def submit(batcher: Batcher, ids: list[list[int]], deadline: float | None = None) -> asyncio.Future:
    return asyncio.ensure_future(batcher.submit(tokens(ids), OUTPUTS, deadline))


async def test_each_request_gets_exactly_its_own_rows() -> None:
    runner = FakeRunner()
    batcher = await make_batcher("own-rows", [runner])
    requests = [[[i + 1] * (1 + i % 5)] for i in range(20)]  # different ids and lengths
    results = await asyncio.gather(*(batcher.submit(tokens(r), OUTPUTS, None) for r in requests))
    for request, result in zip(requests, results, strict=True):
        row = request[0]
        assert result.outputs["embedding"].tolist() == [[sum(row), len(row)]]
        assert result.outputs["last_hidden_state"].shape == (1, len(row), 2)
        assert result.outputs["last_hidden_state"][0, :, 0].tolist() == row
    assert len(runner.batches) < len(requests)  # they were batched
    await batcher.close(WAIT_S)


async def test_a_closing_batcher_refuses_new_requests_but_admits_the_rows_of_accepted_ones() -> None:
    """While it drains, `check_room` refuses a new request; rows submitted then (of a request its front end accepted
    before the drain) are still admitted and answered, until the batcher stops."""
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("drain-accepted", [runner], max_batch_size=1)
    running = submit(batcher, [[1]])
    await runner.started()
    closing = asyncio.ensure_future(batcher.close(WAIT_S))
    await asyncio.sleep(0)  # the drain has begun, with a batch still running
    with pytest.raises(Unavailable, match="shutting down"):
        batcher.check_room()  # new work is refused
    accepted = submit(batcher, [[3, 4]])
    runner.release.set()
    assert (await accepted).outputs["embedding"].tolist() == [[7, 2]]
    await running
    await closing
    with pytest.raises(Unavailable):
        await batcher.submit(tokens([[5]]), OUTPUTS, None)  # stopped


async def test_multi_row_requests_and_output_subsets() -> None:
    batcher = await make_batcher("subsets", [FakeRunner()])
    first = batcher.submit(tokens([[1, 2, 3], [4, 5, 0]]), ("embedding",), None)
    second = batcher.submit(tokens([[7]]), ("last_hidden_state", "embedding"), None)
    a, b = await asyncio.gather(first, second)
    assert list(a.outputs) == ["embedding"]
    assert a.outputs["embedding"].tolist() == [[6, 3], [9, 2]]
    assert b.outputs["last_hidden_state"].shape == (1, 1, 2)
    assert b.outputs["embedding"].tolist() == [[7, 1]]
    await batcher.close(WAIT_S)


async def test_batches_respect_row_and_token_budgets() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("budgets", [runner], max_batch_size=4, max_batch_tokens=40)
    blocker = submit(batcher, [[1]])
    await runner.started()
    pending = [submit(batcher, [[2] * 10]) for _ in range(9)]
    await queued("budgets", 9)
    runner.release.set()
    await asyncio.gather(blocker, *pending)
    assert sum(rows for rows, _ in runner.batches[1:]) == 9
    for rows, length in runner.batches[1:]:
        assert rows <= 4 and rows * length <= 40
    await batcher.close(WAIT_S)


async def test_rows_filling_the_token_budget_at_their_bucketed_length_run_without_waiting_the_delay() -> None:
    """Two rows of 3 tokens, bucketed to 4, fill 8 tokens: a full batch, not one waiting out the 600 s delay."""
    runner = FakeRunner()
    batcher = await make_batcher(
        "bucketed-full", [runner], max_batch_tokens=8, length_bucket=4, max_queue_delay_s=600.0
    )
    first = submit(batcher, [[1, 2, 3]])
    await queued("bucketed-full", 1)
    second = submit(batcher, [[4, 5, 6]])
    await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    assert runner.batches == [(2, 4)]
    await batcher.close(WAIT_S)


def test_selection_groups_similar_lengths_around_the_oldest() -> None:
    loop = asyncio.new_event_loop()
    try:
        items = [
            WorkItem(tokens([[1] * length]), OUTPUTS, loop.create_future(), None) for length in (10, 100, 11, 90, 12, 9)
        ]
    finally:
        loop.close()
    chosen = select_rows(items, policy(max_batch_size=4, max_batch_tokens=10_000))
    assert [item.lengths[row] for item, row in chosen] == [10, 11, 9, 12]
    long_first = select_rows(items[1:], policy(max_batch_size=2, max_batch_tokens=10_000))
    assert [item.lengths[row] for item, row in long_first] == [100, 90]


def test_selection_prefers_rows_of_the_anchors_length_over_older_nearby_ones() -> None:
    """Enough rows of the anchor's own length fill the batch, oldest first, ahead of older rows one token off."""
    lengths = [10, 10, 10, 11, 11, 11, 11, 11, *[10] * 100, 9]
    loop = asyncio.new_event_loop()
    try:
        items = [WorkItem(tokens([[1] * length]), OUTPUTS, loop.create_future(), None) for length in lengths]
    finally:
        loop.close()
    chosen = select_rows(items, policy(max_batch_size=8, max_batch_tokens=10_000))
    assert [items.index(item) for item, _ in chosen] == [0, 1, 2, 8, 9, 10, 11, 12]
    few = select_rows(items[:10], policy(max_batch_size=8, max_batch_tokens=10_000))
    assert [item.lengths[row] for item, row in few] == [10, 10, 10, 10, 10, 11, 11, 11]


async def test_a_full_queue_refuses_at_once_and_a_place_frees_when_a_request_leaves() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("full", [runner], max_queue_size=3, max_batch_size=1)
    running = submit(batcher, [[1]])
    await runner.started()
    waiting = [submit(batcher, [[2]]) for _ in range(3)]
    await queued("full", 3)
    with pytest.raises(Overloaded, match="queue full"):
        batcher.check_room()
    with pytest.raises(Overloaded, match="queue full"):
        await batcher.submit(tokens([[3]]), OUTPUTS, None)
    waiting[0].cancel()
    await queued("full", 2)
    batcher.check_room()  # the cancelled request's place is free again
    runner.release.set()
    await asyncio.gather(running, *waiting[1:])
    await batcher.close(WAIT_S)


async def test_a_cancelled_request_leaves_the_queue_at_once_and_never_runs() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("cancelled", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    doomed, survivor = submit(batcher, [[66]]), submit(batcher, [[77]])
    await queued("cancelled", 2)
    doomed.cancel()
    # Gone from the queue and counted while the model is still busy: not at the next batch.
    await queued("cancelled", 1)
    assert metric("encoder_requests_dropped_total", "cancelled", reason="cancelled") == 1
    runner.release.set()
    await blocker
    assert (await survivor).outputs["embedding"].tolist() == [[77, 1]]
    assert doomed.cancelled()
    assert [shape for shape in runner.batches] == [(1, 1), (1, 1)]  # the blocker and the survivor
    assert metric("encoder_requests_dropped_total", "cancelled", reason="expired") == 0
    await batcher.close(WAIT_S)


async def test_requests_told_by_a_callback_are_answered_expired_and_cancelled_without_a_future() -> None:
    """The engine process's way: `enqueue(on_done=...)`, no future; settled exactly as awaited requests are."""
    told: list[tuple[WorkItem, WorkResult | None, Exception | None]] = []
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("told", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    answered = batcher.enqueue(tokens([[5, 6]]), ("embedding",), None, on_done=lambda *settled: told.append(settled))
    cancelled = batcher.enqueue(tokens([[66]]), OUTPUTS, None, on_done=lambda *settled: told.append(settled))
    expiring = batcher.enqueue(
        tokens([[9]]), OUTPUTS, time.monotonic() + 0.01, on_done=lambda *settled: told.append(settled)
    )
    assert answered.future is None and cancelled.future is None and expiring.future is None
    batcher.cancel(cancelled)
    assert cancelled.settled and metric("encoder_requests_dropped_total", "told", reason="cancelled") == 1
    await until(lambda: len(told) == 1, "the expiry told")
    assert told[0][0] is expiring and told[0][1] is None and isinstance(told[0][2], DeadlineExceeded)
    runner.release.set()
    await blocker
    await until(lambda: len(told) == 2, "the answer told")
    item, result, error = told[1]
    assert item is answered and error is None and item.settled
    assert set(result.outputs) == {"embedding"} and result.outputs["embedding"].tolist() == [[11, 2]]
    assert runner.batches == [(1, 1), (1, 2)]  # the blocker and the answered one: the others never ran
    await batcher.close(WAIT_S)


async def test_a_queued_request_expires_at_its_deadline_while_the_model_is_busy() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("expired", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    expiring = submit(batcher, [[55]], deadline=time.monotonic() + 0.01)
    survivor = submit(batcher, [[77]])
    # The runner is still held: the deadline is enforced by the queue itself, not at the next batch.
    with pytest.raises(DeadlineExceeded):
        await expiring
    assert metric("encoder_requests_dropped_total", "expired", reason="expired") == 1
    assert metric("encoder_queue_depth", "expired") == 1
    runner.release.set()
    await blocker
    assert (await survivor).outputs["embedding"].tolist() == [[77, 1]]
    assert len(runner.batches) == 2  # the blocker and the survivor only
    await batcher.close(WAIT_S)


async def test_a_caller_gone_in_the_same_instant_as_its_expiry_is_counted_once_and_quietly() -> None:
    """gRPC's cancellation and the queue's own expiry timer, both due in one loop iteration.

    The cancellation is handled first, as when gRPC's clock runs slightly ahead: the request must
    be counted once, as expired, and the expiry timer must not fail on the cancelled future.
    """
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("deadline", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    deadline = time.monotonic() + DEADLINE_CLOCK_SLACK_S / 5
    caller = submit(batcher, [[5]], deadline)
    await asyncio.sleep(0)  # submit() runs up to its wait: queued, its expiry timer set for the deadline
    assert metric("encoder_queue_depth", "deadline") == 1
    loop.call_at(deadline - DEADLINE_CLOCK_SLACK_S / 10, caller.cancel)
    time.sleep(DEADLINE_CLOCK_SLACK_S / 2)  # hold the loop: both are overdue when it next looks
    with pytest.raises(asyncio.CancelledError):
        await caller
    await queued("deadline", 0)
    assert metric("encoder_requests_dropped_total", "deadline", reason="expired") == 1
    assert metric("encoder_requests_dropped_total", "deadline", reason="cancelled") == 0
    runner.release.set()
    await blocker
    await batcher.close(WAIT_S)
    assert errors == []


async def test_a_caller_gone_just_before_its_deadline_is_counted_expired() -> None:
    # gRPC's clock may run a few milliseconds ahead of the deadline the server derived: its
    # cancellation then arrives just before the server's own deadline.
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("just-before", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    caller = submit(batcher, [[5]], deadline=time.monotonic() + DEADLINE_CLOCK_SLACK_S / 2)
    await asyncio.sleep(0)  # submit() runs up to its wait: queued, its expiry timer set
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert metric("encoder_requests_dropped_total", "just-before", reason="expired") == 1
    assert metric("encoder_requests_dropped_total", "just-before", reason="cancelled") == 0
    runner.release.set()
    await blocker
    await batcher.close(WAIT_S)


async def test_a_caller_gone_long_before_its_deadline_is_counted_cancelled() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("early", [runner], max_batch_size=1)
    blocker = submit(batcher, [[1]])
    await runner.started()
    caller = submit(batcher, [[5]], deadline=time.monotonic() + 600)
    await queued("early", 1)
    caller.cancel()
    await queued("early", 0)
    assert metric("encoder_requests_dropped_total", "early", reason="cancelled") == 1
    assert metric("encoder_requests_dropped_total", "early", reason="expired") == 0
    runner.release.set()
    await blocker
    await batcher.close(WAIT_S)


async def test_a_failing_batch_fails_only_its_own_requests(caplog: pytest.LogCaptureFixture) -> None:
    runner = FakeRunner(fail_when_id=13)
    runner.release.clear()
    batcher = await make_batcher("failing", [runner], max_batch_size=2)
    blocker = submit(batcher, [[1]])
    await runner.started()
    # Same length, so the first two form one batch; the third (different length) goes alone.
    doomed = [submit(batcher, [[13, 13]]) for _ in range(2)]
    healthy = submit(batcher, [[5, 5, 5, 5, 5, 5]])
    await queued("failing", 3)
    runner.release.set()
    await blocker
    for future in doomed:
        with pytest.raises(ModelFailure, match=EXECUTION_FAILED):  # the cause is the log's, not the client's
            await future
    assert "fake model failure" in caplog.text
    assert (await healthy).outputs["embedding"].tolist() == [[30, 6]]
    after = await batcher.submit(tokens([[2]]), OUTPUTS, None)  # still serving
    assert after.outputs["embedding"].tolist() == [[2, 1]]
    await batcher.close(WAIT_S)


async def test_several_instances_run_batches_at_the_same_time() -> None:
    runners = [FakeRunner(), FakeRunner()]
    for runner in runners:
        runner.release.clear()
    batcher = await make_batcher("instances", runners, max_batch_size=1, max_queue_delay_s=0)
    requests = [submit(batcher, [[i + 1]]) for i in range(2)]
    # Each instance has started a batch while neither has finished: two runs at once.
    for runner in runners:
        await runner.started()
    for runner in runners:
        runner.release.set()
    results = await asyncio.gather(*requests)
    assert [result.outputs["embedding"][0, 0] for result in results] == [1, 2]
    assert [len(runner.batches) for runner in runners] == [1, 1]
    await batcher.close(WAIT_S)


async def test_close_answers_queued_work_then_refuses_new_work() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("close", [runner], max_batch_size=1)
    waiting = [submit(batcher, [[i + 1]]) for i in range(5)]
    await runner.started()
    await queued("close", 4)
    closing = asyncio.ensure_future(batcher.close(WAIT_S))
    await asyncio.sleep(0)  # close() starts: from its first step on, new work is refused
    with pytest.raises(Unavailable):
        batcher.check_room()
    runner.release.set()
    await closing
    assert [(await future).outputs["embedding"][0, 0] for future in waiting] == [1, 2, 3, 4, 5]
    with pytest.raises(Unavailable):
        await batcher.submit(tokens([[1]]), OUTPUTS, None)


async def test_close_with_timeout_fails_leftovers_instead_of_hanging() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("leftovers", [runner], max_batch_size=1)
    running = submit(batcher, [[1]])
    await runner.started()
    stuck = submit(batcher, [[2]])
    await queued("leftovers", 1)
    await batcher.close(0.1)  # the runner stays held: the drain must give up, not wait for it
    with pytest.raises(Unavailable):
        await stuck
    runner.release.set()
    running.cancel()


async def test_rows_of_several_requests_batch_by_length_and_come_back_in_each_requests_order() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("by-length", [runner], max_batch_size=4, max_batch_tokens=20)
    blocker = submit(batcher, [[1]])
    await runner.started()
    short_a, long_a, short_b, long_b = [2, 3], [4] * 9, [5, 6], [7] * 10
    first = submit(batcher, [long_a, short_a])
    second = submit(batcher, [short_b, long_b])
    await queued("by-length", 2)
    runner.release.set()
    await blocker
    a, b = await asyncio.gather(first, second)
    # Each request's rows in its own order, whichever batch they rode in.
    assert a.outputs["embedding"].tolist() == [[sum(long_a), 9], [sum(short_a), 2]]
    assert b.outputs["embedding"].tolist() == [[sum(short_b), 2], [sum(long_b), 10]]
    assert a.outputs["last_hidden_state"].shape == (2, 9, 2) and b.outputs["last_hidden_state"].shape == (2, 10, 2)
    # Past a row's own end, the hidden state is zeros; up to it, the row's own.
    assert a.outputs["last_hidden_state"][1, :, 0].tolist() == short_a + [0] * 7
    # The long rows of both requests ran together, then the short ones: two batches, no long padding for short rows.
    assert runner.batches[1:] == [(2, 10), (2, 2)]
    await batcher.close(WAIT_S)


async def test_a_request_over_the_token_budget_is_spread_over_batches_by_length() -> None:
    runner = FakeRunner()
    batcher = await make_batcher("spread", [runner], max_batch_size=8, max_batch_tokens=100)
    lengths = [5, 50, 6, 48, 7, 40]
    rows = [[index + 1] * length for index, length in enumerate(lengths)]
    result = await batcher.submit(tokens(rows), OUTPUTS, None)
    assert result.outputs["embedding"].tolist() == [[sum(row), len(row)] for row in rows]
    # Longest first, each batch within 100 padded tokens, no row padded past twice its length: (50, 48),
    # (40) alone, then the short ones together.
    assert runner.batches == [(2, 50), (1, 40), (3, 7)]
    assert result.batch_rows == 3
    await batcher.close(WAIT_S)


@pytest.mark.parametrize(
    ("factor", "slack", "expected"),
    [(2.0, 32, [(2, 100), (2, 20)]), (1.25, 16, [(1, 100), (1, 70), (2, 20)])],
)
async def test_how_far_a_row_may_be_padded_is_the_policys(
    factor: float, slack: int, expected: list[tuple[int, int]]
) -> None:
    """70 tokens padded to 100 is within twice its length, not within 1.25 times (nor 70 + 16)."""
    runner = FakeRunner()
    name = f"padding-{factor}"
    batcher = await make_batcher(name, [runner], max_padding_factor=factor, padding_slack_tokens=slack)
    rows = [[1] * 100, [2] * 70, [3] * 20, [4] * 12]
    result = await batcher.submit(tokens(rows), OUTPUTS, None)
    assert result.outputs["embedding"].tolist() == [[sum(row), len(row)] for row in rows]
    assert runner.batches == expected
    await batcher.close(WAIT_S)


async def test_others_are_served_between_the_batches_of_a_large_request() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("between", [runner], max_batch_size=2, max_batch_tokens=1000)
    blocker = submit(batcher, [[1]])
    await runner.started()
    large = submit(batcher, [[2] * 60] * 6)
    small = submit(batcher, [[3] * 5])
    await queued("between", 2)
    runner.release.set()
    await asyncio.gather(blocker, large, small)
    # The large request leads one batch, then goes to the back of the queue: the small one runs next
    # (alone: the large rows would pad it twelve times over), and did not wait behind all of them.
    assert runner.batches[1:] == [(2, 60), (1, 5), (2, 60), (2, 60)]
    assert (await small).outputs["embedding"].tolist() == [[15, 5]]
    assert (await large).outputs["embedding"].tolist() == [[120, 60]] * 6
    await batcher.close(WAIT_S)


async def test_a_request_cancelled_while_a_row_runs_has_its_waiting_rows_dropped() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher("partial-cancel", [runner], max_batch_size=1)
    doomed = submit(batcher, [[66] * 3, [67] * 2, [68]])
    await runner.started()  # its longest row runs; the two others wait
    survivor = submit(batcher, [[77]])
    await queued("partial-cancel", 2)
    doomed.cancel()
    await queued("partial-cancel", 1)
    runner.release.set()
    assert (await survivor).outputs["embedding"].tolist() == [[77, 1]]
    assert runner.batches == [(1, 3), (1, 1)]  # the doomed request's waiting rows never ran
    assert metric("encoder_requests_dropped_total", "partial-cancel", reason="cancelled") == 1
    await batcher.close(WAIT_S)


async def test_a_request_expiring_with_rows_still_waiting_fails_and_they_never_run() -> None:
    # The queue's expiry is a timer on the event loop's clock. The test moves that clock past the deadline
    # once one row runs and the other waits: no wall clock can pass the deadline before the first row has
    # started, however slowly the machine gets there.
    loop = asyncio.get_running_loop()
    real_time = loop.time
    moved_s = 0.0
    loop.time = lambda: real_time() + moved_s
    try:
        runner = FakeRunner()
        runner.release.clear()
        # The running batch's watchdog is a timer on the same clock: beyond the move, so only the expiry is due.
        batcher = await make_batcher("partial-expiry", [runner], max_batch_size=1, max_batch_run_s=3600)
        expiring = submit(batcher, [[55] * 2, [56]], deadline=time.monotonic() + 600)
        await runner.started()  # its longest row runs
        await queued("partial-expiry", 1)  # its other row waits
        assert not expiring.done()
        moved_s = 601.0  # past the deadline: its expiry timer is due
        await until(expiring.done, "the expiry")  # in the loop's next turn, while the runner is still held
        with pytest.raises(DeadlineExceeded):
            await expiring
        assert metric("encoder_queue_depth", "partial-expiry") == 0  # the waiting row left with it
        runner.release.set()
        assert (await batcher.submit(tokens([[2]]), OUTPUTS, None)).outputs["embedding"].tolist() == [[2, 1]]
        assert runner.batches == [(1, 2), (1, 1)]  # its running row, then the later request: not its waiting row
        assert metric("encoder_requests_dropped_total", "partial-expiry", reason="expired") == 1
        await batcher.close(WAIT_S)
    finally:
        del loop.time  # the class's own clock again


async def test_left_padded_and_holed_rows_keep_their_slots_and_mask() -> None:
    runner = FakeRunner()
    batcher = await make_batcher("masks", [runner])
    ids = np.array([[0, 0, 5, 6], [7, 0, 8, 0], [9, 9, 0, 0]], dtype=np.int64)
    rows = TokenRows.from_padded({"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)})
    assert rows.lengths.tolist() == [4, 3, 2]
    result = await batcher.submit(rows, OUTPUTS, None)
    assert result.outputs["embedding"].tolist() == [[11, 2], [15, 2], [18, 2]]
    assert result.outputs["last_hidden_state"][:, :, 0].tolist() == [[0, 0, 5, 6], [7, 0, 8, 0], [9, 9, 0, 0]]
    await batcher.close(WAIT_S)


async def test_a_fault_while_handing_back_a_batch_fails_only_that_batch() -> None:
    class ForgetfulRunner(FakeRunner):
        def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
            produced = super().run(feed, outputs)
            if (feed["input_ids"] == 13).any():
                del produced["last_hidden_state"]  # asked for, never produced: handing back fails
            return produced

    runner = ForgetfulRunner()
    batcher = await make_batcher("handback", [runner])
    with pytest.raises(ModelFailure):
        await batcher.submit(tokens([[13, 13], [14]]), OUTPUTS, None)
    after = await batcher.submit(tokens([[2]]), OUTPUTS, None)
    assert after.outputs["embedding"].tolist() == [[2, 1]]
    await batcher.close(WAIT_S)
