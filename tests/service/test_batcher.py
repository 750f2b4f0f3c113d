"""The batcher in plain asyncio with a fake backend whose answers identify each row."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from service.batcher import Batcher, BatchingPolicy, WorkItem, select_batch
from service.errors import DeadlineExceeded, ModelFailure, Overloaded, Unavailable
from service.metrics import ModelLabels

OUTPUTS = ("last_hidden_state", "embedding")


class FakeRunner:
    """Embedding = (sum of real ids, real length); hidden state echoes ids. Records every batch."""

    def __init__(self, delay_s: float = 0.0, fail_when_id: int | None = None) -> None:
        self.batches: list[tuple[int, int]] = []
        self.delay_s = delay_s
        self.fail_when_id = fail_when_id
        self.release = threading.Event()
        self.release.set()

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        self.release.wait(5)
        time.sleep(self.delay_s)
        ids, mask = feed["input_ids"], feed["attention_mask"]
        self.batches.append(ids.shape)
        if self.fail_when_id is not None and (ids == self.fail_when_id).any():
            raise RuntimeError("fake model failure")
        embedding = np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1).astype(np.float32)
        hidden = np.repeat(ids[:, :, None], 2, axis=2).astype(np.float32)
        produced = {"embedding": embedding, "last_hidden_state": hidden}
        return {name: produced[name] for name in outputs}


def tokens(ids: list[list[int]]) -> dict[str, np.ndarray]:
    array = np.array(ids, dtype=np.int64)
    return {"input_ids": array, "attention_mask": (array != 0).astype(np.int64)}


def policy(**changes) -> BatchingPolicy:
    values = {"max_batch_size": 8, "max_batch_tokens": 1000, "max_queue_delay_s": 0.02, "max_queue_size": 100}
    return BatchingPolicy(**{**values, **changes})


async def make_batcher(runners, **changes) -> Batcher:
    batcher = Batcher(runners, policy(**changes), ModelLabels("fake", "1"), OUTPUTS)
    batcher.start()
    return batcher


async def test_each_request_gets_exactly_its_own_rows() -> None:
    runner = FakeRunner()
    batcher = await make_batcher([runner])
    requests = [[[i + 1] * (1 + i % 5)] for i in range(20)]  # different ids and lengths
    results = await asyncio.gather(*(batcher.submit(tokens(r), OUTPUTS, None) for r in requests))
    for request, result in zip(requests, results, strict=True):
        row = request[0]
        assert result.outputs["embedding"].tolist() == [[sum(row), len(row)]]
        assert result.outputs["last_hidden_state"].shape == (1, len(row), 2)
        assert result.outputs["last_hidden_state"][0, :, 0].tolist() == row
    assert len(runner.batches) < len(requests)  # they were batched
    await batcher.close(1)


async def test_multi_row_requests_and_output_subsets() -> None:
    batcher = await make_batcher([FakeRunner()])
    first = batcher.submit(tokens([[1, 2, 3], [4, 5, 0]]), ("embedding",), None)
    second = batcher.submit(tokens([[7]]), ("last_hidden_state", "embedding"), None)
    a, b = await asyncio.gather(first, second)
    assert list(a.outputs) == ["embedding"]
    assert a.outputs["embedding"].tolist() == [[6, 3], [9, 2]]
    assert b.outputs["last_hidden_state"].shape == (1, 1, 2)
    assert b.outputs["embedding"].tolist() == [[7, 1]]
    await batcher.close(1)


async def test_batches_respect_row_and_token_budgets() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher([runner], max_batch_size=4, max_batch_tokens=40)
    blocker = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.sleep(0.05)  # the runner is now busy with the blocker
    pending = [asyncio.ensure_future(batcher.submit(tokens([[2] * 10]), OUTPUTS, None)) for _ in range(9)]
    await asyncio.sleep(0.01)
    runner.release.set()
    await asyncio.gather(blocker, *pending)
    for rows, length in runner.batches[1:]:
        assert rows <= 4 and rows * length <= 40
    await batcher.close(1)


def test_selection_groups_similar_lengths_around_the_oldest() -> None:
    loop = asyncio.new_event_loop()
    try:
        items = [
            WorkItem(tokens([[1] * length]), OUTPUTS, loop.create_future(), None) for length in (10, 100, 11, 90, 12, 9)
        ]
    finally:
        loop.close()
    chosen = select_batch(items, policy(max_batch_size=4, max_batch_tokens=10_000))
    assert [item.length for item in chosen] == [10, 11, 9, 12]
    long_first = select_batch(items[1:], policy(max_batch_size=2, max_batch_tokens=10_000))
    assert [item.length for item in long_first] == [100, 90]


async def test_full_queue_is_rejected_at_once() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher([runner], max_queue_size=3, max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.sleep(0.05)
    queued = [asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None)) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue full"):
        await batcher.submit(tokens([[3]]), OUTPUTS, None)
    runner.release.set()
    await asyncio.gather(running, *queued)
    await batcher.close(1)


async def test_expired_and_cancelled_requests_are_dropped_before_running() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher([runner], max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.sleep(0.05)
    expiring = asyncio.ensure_future(batcher.submit(tokens([[55]]), OUTPUTS, time.monotonic() + 0.01))
    cancelled = asyncio.ensure_future(batcher.submit(tokens([[66]]), OUTPUTS, None))
    survivor = asyncio.ensure_future(batcher.submit(tokens([[77]]), OUTPUTS, None))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    runner.release.set()
    await running
    with pytest.raises(DeadlineExceeded):
        await expiring
    assert (await survivor).outputs["embedding"].tolist() == [[77, 1]]
    assert cancelled.cancelled()
    assert len(runner.batches) == 2  # the blocker and the survivor only
    await batcher.close(1)


async def test_a_failing_batch_fails_only_its_own_requests() -> None:
    runner = FakeRunner(fail_when_id=13)
    runner.release.clear()
    batcher = await make_batcher([runner], max_batch_size=2)
    blocker = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.sleep(0.05)
    # Same length, so the first two form one batch; the third (different length) goes alone.
    doomed = [asyncio.ensure_future(batcher.submit(tokens([[13, 13]]), OUTPUTS, None)) for _ in range(2)]
    healthy = asyncio.ensure_future(batcher.submit(tokens([[5, 5, 5, 5, 5, 5]]), OUTPUTS, None))
    await asyncio.sleep(0)
    runner.release.set()
    await blocker
    for future in doomed:
        with pytest.raises(ModelFailure, match="fake model failure"):
            await future
    assert (await healthy).outputs["embedding"].tolist() == [[30, 6]]
    after = await batcher.submit(tokens([[2]]), OUTPUTS, None)  # still serving
    assert after.outputs["embedding"].tolist() == [[2, 1]]
    await batcher.close(1)


async def test_several_instances_run_batches_concurrently() -> None:
    runners = [FakeRunner(delay_s=0.1), FakeRunner(delay_s=0.1)]
    batcher = await make_batcher(runners, max_batch_size=1, max_queue_delay_s=0)
    await asyncio.gather(*(batcher.submit(tokens([[i + 1]]), OUTPUTS, None) for i in range(4)))
    assert [len(r.batches) for r in runners] == [2, 2]
    await batcher.close(1)


async def test_close_answers_queued_work_then_refuses_new_work() -> None:
    runner = FakeRunner(delay_s=0.02)
    batcher = await make_batcher([runner], max_batch_size=1)
    queued = [asyncio.ensure_future(batcher.submit(tokens([[i + 1]]), OUTPUTS, None)) for i in range(5)]
    await asyncio.sleep(0)
    await batcher.close(5)
    assert [(await f).outputs["embedding"][0, 0] for f in queued] == [1, 2, 3, 4, 5]
    with pytest.raises(Unavailable):
        await batcher.submit(tokens([[1]]), OUTPUTS, None)


async def test_close_with_timeout_fails_leftovers_instead_of_hanging() -> None:
    runner = FakeRunner()
    runner.release.clear()
    batcher = await make_batcher([runner], max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await asyncio.sleep(0.05)
    stuck = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None))
    await asyncio.sleep(0)
    await batcher.close(0.1)
    with pytest.raises(Unavailable):
        await stuck
    runner.release.set()
    running.cancel()
