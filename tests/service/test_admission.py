"""Admission at the door, cancellation leaving no trace, and runs that never return (plain asyncio, fake model)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from prometheus_client import REGISTRY

from service.core.batcher import Batcher
from service.errors import DeadlineExceeded, Overloaded, Unavailable
from service.ops.metrics import ModelLabels
from tests.service.test_batcher import OUTPUTS, FakeRunner, policy, tokens


class HangingRunner(FakeRunner):
    """A model whose runs block until `release` is set (far beyond any run limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        self.started.set()
        self.release.wait(30)
        return super().run(feed, outputs)


RUN_LIMIT_S = 60.0
"""max_batch_run_s of the watchdog tests: never reached by the wall clock, only by the loop clock the test moves."""


@contextlib.contextmanager
def loop_clock() -> Iterator[Callable[[float], None]]:
    """The running event loop's clock, which the test moves forward: a function that moves it by some seconds.

    The batcher's run watchdog is a timer on this clock. Moved past max_batch_run_s, it fires for the runs under
    way then, exactly when the test says; a healthy run is never declared overlong however slowly the machine
    gets to it, since no wall clock can reach a limit of RUN_LIMIT_S.
    """
    loop = asyncio.get_running_loop()
    real_time = loop.time
    moved_s = 0.0

    def move(seconds: float) -> None:
        nonlocal moved_s
        moved_s += seconds

    loop.time = lambda: real_time() + moved_s  # asyncio schedules and fires timers by loop.time()
    try:
        yield move
    finally:
        del loop.time  # the class's own clock again


def sample(name: str, model: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": model, "version": "1", **labels}) or 0.0


async def make(model: str, runners, **changes) -> Batcher:
    batcher = Batcher(runners, policy(**changes), ModelLabels(model, "1"), OUTPUTS)
    batcher.start()
    return batcher


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


async def test_a_full_queue_refuses_at_submit_the_one_admission_point_and_check_room_says_so_first() -> None:
    runner = HangingRunner()
    batcher = await make("admission", [runner], max_queue_size=2, max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
    batcher.check_room()  # room: checking takes no place
    queued = [asyncio.ensure_future(batcher.submit(tokens([[n]]), OUTPUTS, None)) for n in (2, 3)]
    await wait_until(lambda: sample("encoder_queue_depth", "admission") == 2)
    with pytest.raises(Overloaded, match=r"queue full: 2 requests waiting \(--max-queue-size 2\)") as early:
        batcher.check_room()
    assert early.value.reason == "queue_full"
    with pytest.raises(Overloaded, match="queue full") as refused:
        await batcher.submit(tokens([[4]]), OUTPUTS, None)
    assert refused.value.reason == "queue_full"
    runner.release.set()
    assert [(await q).outputs["embedding"].tolist() for q in queued] == [[[2, 1]], [[3, 1]]]
    await running
    batcher.check_room()  # the queue emptied: room again
    await batcher.close(1)


async def test_a_cancelled_request_leaves_the_queue_at_once_and_is_counted() -> None:
    runner = HangingRunner()
    batcher = await make("cancel", [runner], max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
    queued = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None))
    await wait_until(lambda: sample("encoder_queue_depth", "cancel") == 1)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    # Gone while the only instance is still busy: nothing waits for a batch to notice it.
    assert sample("encoder_queue_depth", "cancel") == 0
    assert sample("encoder_requests_dropped_total", "cancel", reason="cancelled") == 1
    runner.release.set()
    await running
    assert runner.batches == [(1, 1)]  # the cancelled request never ran
    await batcher.close(1)


async def test_a_deadline_expires_in_the_queue_while_the_instance_is_busy() -> None:
    runner = HangingRunner()
    batcher = await make("expire", [runner], max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(tokens([[2]]), OUTPUTS, time.monotonic() + 0.05)
    assert sample("encoder_requests_dropped_total", "expire", reason="expired") == 1
    assert sample("encoder_queue_depth", "expire") == 0
    runner.release.set()
    await running
    assert runner.batches == [(1, 1)]
    await batcher.close(1)


async def test_a_run_that_never_returns_fails_its_requests_and_takes_the_model_out_of_service() -> None:
    runner = HangingRunner()
    with loop_clock() as move_clock:
        batcher = await make("stuck", [runner], max_batch_size=1, max_batch_run_s=RUN_LIMIT_S)
        changes: list[bool] = []
        batcher.on_serving_change = changes.append
        stuck = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
        await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
        queued = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None))
        await wait_until(lambda: sample("encoder_queue_depth", "stuck") == 1)  # waiting behind the stuck run
        assert not stuck.done() and batcher.serving  # nothing is overlong until the limit has passed
        move_clock(RUN_LIMIT_S + 1)
        await wait_until(stuck.done)  # due at once: the watchdog fires in the loop's next turn
        with pytest.raises(Unavailable, match=r"did not finish this request's batch within 60 s"):
            await stuck
        with pytest.raises(Unavailable, match="no model instance is in service"):
            await queued
        assert changes == [False]
        assert not batcher.serving
        assert sample("encoder_stuck_instances", "stuck") == 1
        with pytest.raises(Unavailable) as refused:
            await batcher.submit(tokens([[4]]), OUTPUTS, None)
        assert refused.value.reason == "no_instance"

        runner.release.set()  # the run finally returns: the instance is back
        await wait_until(lambda: batcher.serving)
        assert changes == [False, True]
        assert sample("encoder_stuck_instances", "stuck") == 0
        after = await batcher.submit(tokens([[3]]), OUTPUTS, None)
        assert after.outputs["embedding"].tolist() == [[3, 1]]
        await batcher.close(1)


async def test_with_two_instances_one_stuck_run_leaves_the_other_serving() -> None:
    hanging, healthy = HangingRunner(), FakeRunner()
    with loop_clock() as move_clock:
        batcher = await make("half-stuck", [hanging, healthy], max_batch_size=1, max_batch_run_s=RUN_LIMIT_S)
        changes: list[bool] = []
        batcher.on_serving_change = changes.append
        first = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
        await asyncio.get_running_loop().run_in_executor(None, hanging.started.wait, 5)
        move_clock(RUN_LIMIT_S + 1)
        await wait_until(first.done)  # due at once: the watchdog fires in the loop's next turn
        with pytest.raises(Unavailable, match=r"did not finish this request's batch within 60 s"):
            await first
        assert batcher.serving and changes == []
        assert sample("encoder_stuck_instances", "half-stuck") == 1
        answers = await asyncio.gather(*(batcher.submit(tokens([[i + 2]]), OUTPUTS, None) for i in range(3)))
        assert [a.outputs["embedding"].tolist() for a in answers] == [[[2, 1]], [[3, 1]], [[4, 1]]]
        hanging.release.set()
        await wait_until(lambda: sample("encoder_stuck_instances", "half-stuck") == 0)
        await batcher.close(1)
