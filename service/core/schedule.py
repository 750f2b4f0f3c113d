"""The order in which queued requests lead batches: priority levels, tenants' fair shares, no level starved.

A request's rows wait at its priority (1 the highest, as Triton numbers its levels). The next
batch belongs to the highest level with rows waiting, and holds rows of that level only: a
query's batch never carries bulk rows, which would make it run longer. While higher levels keep
the engine busy, a lower level with rows waiting is passed over; once it has been passed over by
as many batches as its minimum share allows (`min_lower_share`: 0.1, one batch in ten), it leads
the next one, so every level progresses.

Within a level, tenants share the engine by weight (start-time fair queuing): each request gets a
start tag, the later of the level's virtual time and its tenant's previous request's finish tag,
and a finish tag its rows divided by its tenant's weight later; requests lead in the order of their
start tags (arrival among equals). A tenant queuing steadily is served rows in proportion to its
weight against the others queuing steadily; a tenant that queued nothing for a while starts at the
level's virtual time (the start tag of the latest request to lead), with no credit saved up, so a
tenant with nothing queued costs the others nothing. Without tenants (API keys off) every request
is the same tenant's, and a level is first come, first served.

A request larger than one batch goes behind its tenant's later requests after each batch it
leads (it is tagged again as if it arrived then), so it is spread over batches by length while
others are served between them.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from service.core.rows import WorkItem
from service.ops import metrics


@dataclass(slots=True)
class _Level:
    """One priority level's queue: its requests in start-tag order, and what it holds."""

    items: list[WorkItem]
    virtual_time: float = 0.0
    """The start tag of the latest request to lead a batch at this level."""
    finish_tags: dict[str, float] | None = None
    """Each tenant's latest finish tag at this level."""
    rows: int = 0
    """Rows waiting at this level."""
    tokens: int = 0
    """Tokens of the rows waiting at this level."""
    passed_over: int = 0
    """Batches formed in a row while this level had rows waiting and got none of them."""


class RunQueue:
    """A model's queued requests, by priority level and, within a level, by their tenants' fair shares."""

    def __init__(self, levels: int, min_lower_share: float, labels: tuple[str, str] = ("", "")) -> None:
        if levels < 1:
            raise ValueError("a queue needs at least one priority level")
        self._labels = labels
        self._gauges: dict[tuple[int, str], metrics.Gauge] = {}
        """encoder_queue_rows of each priority and tenant seen, resolved once."""
        self._levels = [_Level([], finish_tags={}) for _ in range(levels)]
        self._sequence = itertools.count()
        self._skips_allowed = math.inf if min_lower_share <= 0 else max(0, math.ceil(1 / min_lower_share) - 1)
        """Batches a waiting lower level may be passed over in a row before it leads one."""

    def __len__(self) -> int:
        return sum(len(level.items) for level in self._levels)

    def __bool__(self) -> bool:
        return any(level.items for level in self._levels)

    def __iter__(self) -> Iterator[WorkItem]:
        """Every queued request, highest level first, each level in its order."""
        for level in self._levels:
            yield from level.items

    @property
    def waiting_rows(self) -> int:
        """Rows waiting at every level."""
        return sum(level.rows for level in self._levels)

    def ahead(self, priority: int) -> tuple[int, int, int]:
        """Requests, rows and tokens waiting at `priority` or higher: what a new request of that priority is behind."""
        levels = self._levels[:priority]
        return (
            sum(len(level.items) for level in levels),
            sum(level.rows for level in levels),
            sum(level.tokens for level in levels),
        )

    def add(self, item: WorkItem) -> None:
        """Queue a request at its share's level, tagged for its tenant's turn."""
        level = self._levels[item.share.priority - 1]
        self._tag(level, item)
        bisect.insort(level.items, item, key=_order)
        level.rows += len(item.waiting)
        level.tokens += sum(item.lengths[row] for row in item.waiting)
        self._gauge(item).inc(len(item.waiting))

    def remove(self, item: WorkItem) -> None:
        """Take a request's waiting rows out of the queue (it was answered, failed, cancelled or expired)."""
        level = self._levels[item.share.priority - 1]
        level.items.remove(item)
        self._forget(level, item.waiting, item)

    def top(self) -> list[WorkItem]:
        """The highest priority's requests, in their order (empty when none wait)."""
        return self._levels[0].items

    def leading(self) -> list[WorkItem]:
        """The requests the next batch is chosen from, in their order: the level whose turn it is."""
        waiting = [level for level in self._levels if level.items]
        if not waiting:
            return []
        owed = [level for level in waiting[1:] if level.passed_over >= self._skips_allowed]
        return (owed[0] if owed else waiting[0]).items

    def taken(
        self, items: list[WorkItem], rows: dict[WorkItem, list[int]], max_batch_size: int, *, beside: bool = False
    ) -> None:
        """A batch took these rows from `items` (one level's, their leader first): the queue follows.

        The level's virtual time moves to its leader's start tag; requests left with no waiting rows
        leave; a leader larger than one batch goes behind its tenant's later requests. Every other
        level with rows waiting was passed over once more, unless the batch runs `beside` the
        others (the express lane), taking no instance from them.
        """
        leader = items[0]
        level = self._levels[leader.share.priority - 1]
        level.virtual_time = max(level.virtual_time, leader.start_tag)
        for item, taken in rows.items():
            self._forget(level, taken, item)
        if leader.waiting and len(leader.lengths) > max_batch_size:
            level.items.remove(leader)
            self._tag(level, leader)
            bisect.insort(level.items, leader, key=_order)
        level.items[:] = [item for item in level.items if item.waiting]
        level.passed_over = 0
        if beside:
            return
        for other in self._levels:
            if other is not level and other.items:
                other.passed_over += 1

    def _tag(self, level: _Level, item: WorkItem) -> None:
        """Give a request its start tag (its turn among its level's tenants) and its sequence (arrival)."""
        tenant, weight = item.share.tenant, item.share.weight
        start = max(level.virtual_time, level.finish_tags.get(tenant, 0.0))
        level.finish_tags[tenant] = start + len(item.waiting) / weight
        item.start_tag = start
        item.sequence = next(self._sequence)
        if len(level.finish_tags) > len(level.items) + 64:
            # Tenants long gone have finish tags behind the virtual time: they no longer order anything.
            level.finish_tags = {
                name: tag for name, tag in level.finish_tags.items() if tag > level.virtual_time or name == tenant
            }

    def _forget(self, level: _Level, rows: list[int], item: WorkItem) -> None:
        level.rows -= len(rows)
        level.tokens -= sum(item.lengths[row] for row in rows)
        self._gauge(item).dec(len(rows))

    def _gauge(self, item: WorkItem) -> metrics.Gauge:
        key = (item.share.priority, item.share.tenant)
        gauge = self._gauges.get(key)
        if gauge is None:
            gauge = self._gauges[key] = metrics.QUEUE_ROWS.labels(*self._labels, str(key[0]), key[1])
        return gauge


def _order(item: WorkItem) -> tuple[float, int]:
    return item.start_tag, item.sequence
