"""The ingestion's adaptive window (client.window): it grows while answers show no queue, shrinks while they do."""

from __future__ import annotations

import asyncio

import pytest

from client.window import QUEUED_HIGH, START, AdaptiveWindow


def answer_rounds(window: AdaptiveWindow, latency_s: float, rounds: int) -> None:
    """`rounds` rounds of answers, each `latency_s` after its request, the window kept full."""
    for _ in range(rounds):
        for _ in range(window.size):
            window._out += 1  # as acquire does, without waiting: the window is full again at once
            window.release(latency_s)


def test_it_grows_to_its_limit_while_nothing_waits_in_the_servers_queue() -> None:
    window = AdaptiveWindow(limit=8)
    assert window.size == START
    answer_rounds(window, 0.1, rounds=20)
    assert window.size == 8


def test_it_shrinks_while_answers_show_a_backlog() -> None:
    window = AdaptiveWindow(limit=16)
    answer_rounds(window, 0.1, rounds=20)
    assert window.size == 16
    # Ten times slower than the fastest answer: about 14 of 16 requests wait in the server's queue.
    answer_rounds(window, 1.0, rounds=5)
    assert window.size == 11
    answer_rounds(window, 1.0, rounds=200)
    assert window.size == 3  # 3 x (1 - 0.1) = 2.7 requests waiting: no more than QUEUED_HIGH


def test_it_settles_where_between_one_and_three_requests_wait() -> None:
    window = AdaptiveWindow(limit=32)
    for _ in range(200):  # latency grows with what is in flight beyond the two the server runs at once
        fastest_s = 0.1
        latency_s = fastest_s * max(1.0, window.size / 2)
        answer_rounds(window, latency_s, rounds=1)
    queued = window.size * (1 - 0.1 / (0.1 * max(1.0, window.size / 2)))
    assert 1 <= queued <= QUEUED_HIGH


async def test_acquire_waits_for_room_and_a_release_without_an_answer_changes_nothing() -> None:
    window = AdaptiveWindow(limit=4)
    await window.acquire()
    await window.acquire()
    third = asyncio.ensure_future(window.acquire())
    await asyncio.sleep(0)
    assert not third.done()
    window.release()  # sent again, not answered: no latency to learn from
    await asyncio.wait_for(third, 5)
    assert window.size == START


def test_a_window_needs_room_for_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AdaptiveWindow(limit=0)
