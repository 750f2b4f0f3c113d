"""Image rows in the core: batched by the same batcher as token rows (row cap, each request's rows back in its
order) and carried over the engine's wire (float32 pixels among int64 token words)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from service.core import wire
from service.core.batcher import Batcher
from service.core.policy import BatchingPolicy
from service.core.rows import PixelRows, TokenRows
from service.core.towers import PIXEL_VALUES
from service.ops import statistics
from service.ops.metrics import ModelLabels

PIXEL_SHAPE = (3, 1, 3)
"""An image row's shape: odd, so that a request of an odd number of images ends mid-word on the wire."""


class PixelRunner:
    """Embedding = (the image's first pixel value, its pixel sum). Records each batch's rows."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        pixels = feed[PIXEL_VALUES]
        assert pixels.dtype == np.float32
        assert pixels.shape[1:] == PIXEL_SHAPE
        self.batches.append(len(pixels))
        flat = pixels.reshape(len(pixels), -1)
        return {"embedding": np.stack([flat[:, 0], flat.sum(axis=1)], axis=1)}


def images(first: int, count: int) -> PixelRows:
    """`count` images whose first pixel values are first, first + 1, ...: each row tells which image it is."""
    pixels = np.ones((count, *PIXEL_SHAPE), dtype=np.float32)
    pixels[:, 0, 0, 0] = np.arange(first, first + count)
    return PixelRows(pixels)


async def test_image_rows_batch_within_the_row_cap_and_come_back_in_each_requests_order() -> None:
    runner = PixelRunner()
    policy = BatchingPolicy(max_batch_size=4, max_batch_tokens=2, max_queue_delay_s=0.02, max_queue_size=100)
    batcher = Batcher([runner], policy, ModelLabels("image-rows", "1"), ("embedding",))
    batcher.start()
    requests = [images(100, 3), images(200, 1), images(300, 6), images(400, 2)]
    results = await asyncio.gather(*(batcher.submit(rows, ("embedding",), None) for rows in requests))
    for rows, result in zip(requests, results, strict=True):
        embedding = result.outputs["embedding"]
        np.testing.assert_array_equal(embedding[:, 0], rows.pixel_values[:, 0, 0, 0])
        np.testing.assert_array_equal(embedding[:, 1], rows.pixel_values.reshape(rows.rows, -1).sum(axis=1))
    assert sum(runner.batches) == 12
    assert max(runner.batches) <= 4
    assert len(runner.batches) >= 3
    await batcher.close(1)


def test_image_rows_travel_among_token_rows_on_the_wire() -> None:
    """An odd number of float32 values is padded to whole words: the token rows after them read as sent."""
    pixels = images(7, 1)
    tokens = TokenRows(np.array([5, 6, 7], np.int64), np.array([2, 1], np.int64), 2)
    first, first_buffers = wire.submit_message(1, "m", "", pixels, ("embedding",), deadline=None)
    second, second_buffers = wire.submit_message(2, "m", "", tokens, ("embedding",), deadline=None)
    header = wire.encode([first, second])
    payload = b"".join(bytes(buffer) for buffer in (*first_buffers, *second_buffers))
    words = np.frombuffer(payload, np.int64)
    decoded_first, decoded_second = wire.decode_to_engine(header)
    got_pixels, offset = wire.rows_of(decoded_first, words, 0)
    got_tokens, end = wire.rows_of(decoded_second, words, offset)
    assert isinstance(got_pixels, PixelRows)
    np.testing.assert_array_equal(got_pixels.pixel_values, pixels.pixel_values)
    np.testing.assert_array_equal(got_tokens.input_ids, tokens.input_ids)
    np.testing.assert_array_equal(got_tokens.lengths, tokens.lengths)
    assert end == len(words)


class HeldRunner(PixelRunner):
    """A PixelRunner whose batches wait until `release` is set (on the batcher's worker thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def run(self, feed: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.release.wait(10)
        return super().run(feed, outputs)


async def test_a_models_two_queues_add_up_in_its_queue_depth() -> None:
    """A two-tower model's text and image queues share the model's statistics: its queue depth is their sum."""
    labels = ModelLabels("two-queues", "1")
    policy = BatchingPolicy(max_batch_size=1, max_batch_tokens=1, max_queue_delay_s=0, max_queue_size=100)
    runners = [HeldRunner(), HeldRunner()]
    batchers = [Batcher([runner], policy, labels, ("embedding",)) for runner in runners]
    for batcher in batchers:
        batcher.start()
    calls = [asyncio.ensure_future(batcher.submit(images(1, 1), ("embedding",), None)) for batcher in batchers]
    for runner in runners:
        await asyncio.to_thread(runner.entered.wait, 10)  # each queue's first request is running
    calls += [asyncio.ensure_future(batchers[0].submit(images(2, 1), ("embedding",), None)) for _ in range(2)]
    calls += [asyncio.ensure_future(batchers[1].submit(images(3, 1), ("embedding",), None)) for _ in range(3)]
    await asyncio.sleep(0)
    assert statistics.TABLES.snapshot("two-queues", "1").pending == 5
    for runner in runners:
        runner.release.set()
    await asyncio.gather(*calls)
    assert statistics.TABLES.snapshot("two-queues", "1").pending == 0
    for batcher in batchers:
        await batcher.close(1)
