"""The queue's order (service.core.schedule) through a real batcher: priorities, tenants' shares, no level starved.

The fake runner records the ids of every batch it runs, so a test reads the order rows ran in. A
test holds the runner on its first batch, queues what it needs, then lets everything run: nothing
waits on a clock.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.core.batcher import Batcher
from service.core.rows import Share
from service.core.schedule import RunQueue
from service.errors import InvalidArgument, Overloaded
from service.ops.metrics import ModelLabels
from tests.service.test_batcher import OUTPUTS, FakeRunner, policy, queued, tokens


class RecordingRunner(FakeRunner):
    """A fake runner that also records each batch's first ids (one per row), in the order batches ran."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[int]] = []

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        result = super().run(feed, outputs)
        self.rows.append(feed["input_ids"][:, 0].tolist())
        return result


async def held_batcher(name: str, **changes: float) -> tuple[Batcher, RecordingRunner, asyncio.Future]:
    """A started batcher of two priority levels whose runner holds its first batch (id 1) until released."""
    runner = RecordingRunner()
    runner.release.clear()
    changes = {"max_queue_delay_s": 0, "priority_levels": 2, **changes}
    batcher = Batcher([runner], policy(**changes), ModelLabels(name, "1"), OUTPUTS)
    batcher.start()
    first = asyncio.ensure_future(batcher.submit(tokens([[1]]), OUTPUTS, None))
    await runner.started()
    return batcher, runner, first


def send(batcher: Batcher, first_id: int, share: Share, rows: int = 1) -> asyncio.Future:
    """A request of `rows` one-token rows, ids first_id, first_id + 1, ..."""
    ids = [[first_id + row] for row in range(rows)]
    return asyncio.ensure_future(batcher.submit(tokens(ids), OUTPUTS, None, share=share))


async def run_all(runner: RecordingRunner, first: asyncio.Future, futures: list[asyncio.Future]) -> list[list[int]]:
    """Release the runner, wait for every request; the batches that ran after the held one."""
    runner.release.set()
    await asyncio.gather(first, *futures)
    return runner.rows[1:]


async def test_higher_priority_rows_run_before_lower_ones_queued_earlier() -> None:
    batcher, runner, first = await held_batcher("priority-order", priority_levels=3, max_batch_size=1)
    low = [send(batcher, 300 + i, Share(3)) for i in range(3)]
    middle = [send(batcher, 200 + i, Share(2)) for i in range(2)]
    high = [send(batcher, 100 + i, Share(1)) for i in range(2)]
    await queued("priority-order", 7)
    order = [batch[0] for batch in await run_all(runner, first, low + middle + high)]
    assert order == [100, 101, 200, 201, 300, 301, 302]


async def test_a_batch_holds_rows_of_one_priority_only() -> None:
    batcher, runner, first = await held_batcher("one-level", max_batch_size=8, priority_levels=2)
    low = send(batcher, 20, Share(2), rows=3)
    high = send(batcher, 10, Share(1), rows=2)
    await queued("one-level", 2)
    batches = await run_all(runner, first, [low, high])
    assert batches == [[10, 11], [20, 21, 22]]


async def test_tenants_of_one_priority_get_rows_in_proportion_to_their_weights() -> None:
    batcher, runner, first = await held_batcher("weights", max_batch_size=4)
    heavy = [send(batcher, 1000 + i, Share(1, "heavy", 3.0)) for i in range(40)]
    light = [send(batcher, 5000 + i, Share(1, "light", 1.0)) for i in range(40)]  # queued after all of heavy's
    await queued("weights", 80)
    batches = await run_all(runner, first, heavy + light)
    served = [row for batch in batches[:8] for row in batch]  # 32 rows while both tenants had rows queued
    assert sum(row >= 5000 for row in served) == 8
    assert sum(row < 5000 for row in served) == 24
    assert sorted(row for row in served if row < 5000) == list(range(1000, 1024))  # each tenant in its own order


async def test_a_tenant_that_was_idle_saves_no_credit() -> None:
    batcher, runner, first = await held_batcher("no-credit", max_batch_size=1)
    busy = [send(batcher, 100 + i, Share(1, "busy")) for i in range(20)]
    await queued("no-credit", 20)
    runner.release.set()
    await asyncio.gather(first, *busy)  # busy ran 20 rows alone; the idle tenant queued nothing meanwhile
    runner.release.clear()
    again = asyncio.ensure_future(batcher.submit(tokens([[2]]), OUTPUTS, None))
    await runner.started()
    busy = [send(batcher, 300 + i, Share(1, "busy")) for i in range(4)]
    idle = [send(batcher, 700 + i, Share(1, "idle")) for i in range(4)]
    await queued("no-credit", 8)
    order = [batch[0] for batch in (await run_all(runner, again, busy + idle))[21:]]
    # Turn about from now on: the idle tenant does not run its four first on credit for the time it sent nothing.
    assert [sorted(order[i : i + 2]) for i in range(0, 8, 2)] == [[300 + i, 700 + i] for i in range(4)]


@pytest.mark.parametrize(
    ("share", "order"),
    [
        (0.25, [100, 101, 102, 900, 103, 104, 105, 106, 107]),  # one batch in four is the waiting lower level's
        (0.0, [*range(100, 108), 900]),  # strict: the lower level runs once nothing higher waits
    ],
)
async def test_a_lower_priority_leads_a_batch_once_passed_over_as_often_as_its_share_allows(
    share: float, order: list[int]
) -> None:
    name = f"min-share-{share}"
    batcher, runner, first = await held_batcher(name, max_batch_size=1, min_lower_priority_share=share)
    low = send(batcher, 900, Share(2))
    high = [send(batcher, 100 + i, Share(1)) for i in range(8)]
    await queued(name, 9)
    assert [batch[0] for batch in await run_all(runner, first, [low, *high])] == order


async def test_a_bulk_backlog_refuses_bulk_but_not_a_higher_priority() -> None:
    batcher, runner, first = await held_batcher("bounded", max_queue_rows=4)
    bulk = [send(batcher, 10 * i, Share(2), rows=2) for i in range(1, 3)]
    await queued("bounded", 2)
    with pytest.raises(Overloaded) as refused:
        await batcher.submit(tokens([[77]]), OUTPUTS, None, share=Share(2))
    assert "4 rows waiting at priority 2 or higher (--max-queue-rows 4)" in str(refused.value)
    assert refused.value.retry_after_s >= 1
    query = send(batcher, 5, Share(1))  # nothing queued at its priority: admitted
    batches = await run_all(runner, first, [*bulk, query])
    assert batches[0] == [5]


async def test_the_token_bound_counts_the_rows_tokens() -> None:
    batcher, runner, first = await held_batcher("token-bound", max_queue_tokens=6)
    long = asyncio.ensure_future(batcher.submit(tokens([[3, 3, 3, 3, 3, 3]]), OUTPUTS, None))
    await queued("token-bound", 1)
    with pytest.raises(Overloaded, match=r"6 tokens waiting at priority 1 or higher \(--max-queue-tokens 6\)"):
        await batcher.submit(tokens([[4]]), OUTPUTS, None)
    await run_all(runner, first, [long])


async def test_a_priority_outside_the_levels_is_refused_and_nothing_queued() -> None:
    batcher, runner, first = await held_batcher("bad-priority", priority_levels=2)
    with pytest.raises(InvalidArgument, match=r"priority 3 is not a level of this model \(1, the highest, to 2\)"):
        await batcher.submit(tokens([[4]]), OUTPUTS, None, share=Share(3))
    assert batcher.queue_depth == 0
    await run_all(runner, first, [])


def test_a_queue_needs_a_level() -> None:
    with pytest.raises(ValueError, match="at least one priority level"):
        RunQueue(0, 0.1)


class LaneRunner(FakeRunner):
    """A fake runner that holds only the batches led by id 1 (two threads may run it at once)."""

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        if feed["input_ids"][0, 0] == 1:
            return super().run(feed, outputs)
        return FakeRunner().run(feed, outputs)


async def lane_batcher(name: str, **changes: float) -> tuple[Batcher, LaneRunner]:
    runner = LaneRunner()
    runner.release.clear()
    changes = {"max_queue_delay_s": 0, "priority_levels": 2, "express_lane": True, **changes}
    batcher = Batcher([runner], policy(**changes), ModelLabels(name, "1"), OUTPUTS)
    batcher.start()
    return batcher, runner


async def test_a_query_runs_beside_bulk_work_that_holds_every_instance() -> None:
    batcher, runner = await lane_batcher("express")
    bulk = send(batcher, 1, Share(2), rows=3)
    await runner.started()
    query = await batcher.submit(tokens([[5, 6]]), OUTPUTS, None, share=Share(1))
    assert query.outputs["embedding"].tolist() == [[11, 2]]
    assert not bulk.done()  # the query was answered while the bulk run still held the only instance
    runner.release.set()
    assert (await bulk).outputs["embedding"].shape == (3, 2)


async def test_without_the_express_lane_a_query_waits_for_the_bulk_run() -> None:
    batcher, runner = await lane_batcher("no-express", express_lane=False)
    bulk = send(batcher, 1, Share(2))
    await runner.started()
    query = send(batcher, 5, Share(1))
    await queued("no-express", 1)
    assert not query.done()
    runner.release.set()
    await asyncio.gather(bulk, query)


async def test_the_express_lane_never_doubles_the_highest_priority() -> None:
    batcher, runner = await lane_batcher("express-top")
    first = send(batcher, 1, Share(1))
    await runner.started()
    second = send(batcher, 5, Share(1))
    await queued("express-top", 1)  # it waits for the instance: only bulk work is run beside
    assert not second.done()
    runner.release.set()
    await asyncio.gather(first, second)
