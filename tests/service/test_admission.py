"""Admission at the door, cancellation leaving no trace, and runs that never return (plain asyncio, fake model)."""

from __future__ import annotations

import asyncio
import threading
import time

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


async def test_admitted_requests_hold_queue_places_until_queued_or_withdrawn() -> None:
    runner = HangingRunner()
    batcher = await make("admission", [runner], max_queue_size=2, max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
    batcher.admit()
    batcher.admit()  # two places taken by requests still being tokenised
    with pytest.raises(Overloaded, match=r"queue full: 2 requests waiting \(--max-queue-size 2\)") as refused:
        batcher.admit()
    assert refused.value.reason == "queue_full"
    batcher.withdraw()  # one gave up (e.g. its texts failed to tokenise)
    queued = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None, admitted=True))
    await asyncio.sleep(0)
    batcher.admit()  # its place became a queue entry; the withdrawn one is free again
    with pytest.raises(Overloaded):
        batcher.admit()
    runner.release.set()
    assert (await queued).outputs["embedding"].tolist() == [[2, 1]]
    await running
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
    batcher = await make("stuck", [runner], max_batch_size=1, max_batch_run_s=0.1)
    changes: list[bool] = []
    batcher.on_serving_change = changes.append
    stuck = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, runner.started.wait, 5)
    queued = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None))
    with pytest.raises(Unavailable, match=r"did not finish this request's batch within 0.1 s"):
        await stuck
    with pytest.raises(Unavailable, match="no model instance is in service"):
        await queued
    assert changes == [False]
    assert not batcher.serving
    assert sample("encoder_stuck_instances", "stuck") == 1
    with pytest.raises(Unavailable) as refused:
        batcher.admit()
    assert refused.value.reason == "no_instance"

    runner.release.set()  # the run finally returns: the instance is back
    await wait_until(lambda: batcher.serving)
    assert changes == [False, True]
    assert sample("encoder_stuck_instances", "stuck") == 0
    batcher.admit()
    after = await batcher.submit(tokens([[3]]), OUTPUTS, None, admitted=True)
    assert after.outputs["embedding"].tolist() == [[3, 1]]
    await batcher.close(1)


async def test_with_two_instances_one_stuck_run_leaves_the_other_serving() -> None:
    hanging, healthy = HangingRunner(), FakeRunner()
    batcher = await make("half-stuck", [hanging, healthy], max_batch_size=1, max_batch_run_s=0.1)
    changes: list[bool] = []
    batcher.on_serving_change = changes.append
    first = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.get_running_loop().run_in_executor(None, hanging.started.wait, 5)
    with pytest.raises(Unavailable):
        await first
    assert batcher.serving and changes == []
    answers = await asyncio.gather(*(batcher.submit(tokens([[i + 2]]), OUTPUTS, None) for i in range(3)))
    assert [a.outputs["embedding"].tolist() for a in answers] == [[[2, 1]], [[3, 1]], [[4, 1]]]
    hanging.release.set()
    await wait_until(lambda: sample("encoder_stuck_instances", "half-stuck") == 0)
    await batcher.close(1)
