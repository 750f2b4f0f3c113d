"""The batch layout: chosen rows become one padded feed, and a batch's outputs become each request's.

A batch is padded to its own (bucketed) longest row: each array is filled in one step from the
rows' tokens laid end to end. Its outputs go back row by row to the requests they came from, each
request's rows in its own order, a per-position output cut at each row's end (zeros past it, up to
the request's own width).

An image tower's batch is its rows' pixel values stacked (`pixel_values`): images of one model all have one
shape, so nothing is padded.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np

from service.core.policy import BatchingPolicy
from service.core.rows import IMAGE_ROW_TOKENS, PixelRows, WorkItem
from service.core.towers import PIXEL_VALUES


class Group(msgspec.Struct, eq=False, gc=False):
    """One request's rows in a batch: which rows (ascending), from which position of the batch."""

    item: WorkItem
    rows: list[int]
    start: int


def padded_feed(groups: list[Group], policy: BatchingPolicy) -> tuple[dict[str, np.ndarray], int]:
    """The batch's feed, every row right-padded to the batch's (bucketed) longest; and its real tokens.

    Each array is filled in one step from the rows' tokens laid end to end: the positions kept
    (row by row, up to each row's length) are the same, in the same order, as those tokens. Image rows
    (a queue holds one kind) are stacked as the image graph's pixel_values.
    """
    if isinstance(groups[0].item.rows, PixelRows):
        return _pixel_feed(groups)
    ids: list[np.ndarray] = []
    lengths: list[int] = []
    masked = typed = adapted = False
    for group in groups:
        item = group.item
        tokens, starts, item_lengths = item.rows, item.starts, item.lengths
        masked = masked or tokens.attention_mask is not None
        typed = typed or tokens.token_type_ids is not None
        adapted = adapted or tokens.adapter_ids is not None
        if len(item_lengths) == 1:  # most requests: one text, its ids whole
            lengths.append(item_lengths[0])
            ids.append(tokens.input_ids)
            continue
        for row in group.rows:
            start, length = starts[row], item_lengths[row]
            lengths.append(length)
            ids.append(tokens.input_ids[start : start + length])
    shape = (len(lengths), policy.padded_length(max(lengths)))
    # Rows that all fill the batch (one text, or equal lengths) need no padding placed.
    kept = None if min(lengths) == shape[1] else np.arange(shape[1]) < np.array(lengths)[:, None]
    feed_ids = _laid_out(ids[0] if len(ids) == 1 else np.concatenate(ids), kept, shape, policy.pad_token_id)
    if masked:
        feed_mask = _laid_out(np.concatenate(list(_each_row(groups, "attention_mask", 1))), kept, shape, 0)
    else:
        feed_mask = np.ones(shape, dtype=np.int64) if kept is None else kept.astype(np.int64)
    if typed:
        feed_types = _laid_out(np.concatenate(list(_each_row(groups, "token_type_ids", 0))), kept, shape, 0)
    else:
        feed_types = np.zeros(shape, dtype=np.int64)
    real_tokens = int(np.count_nonzero(feed_mask)) if masked else sum(lengths)
    feed = {"input_ids": feed_ids, "attention_mask": feed_mask, "token_type_ids": feed_types}
    if adapted:
        feed["adapter_ids"] = _laid_out(np.concatenate(list(_each_row(groups, "adapter_ids", 0))), kept, shape, 0)
    else:
        feed["adapter_ids"] = np.zeros(shape, dtype=np.int64)
    return feed, real_tokens


def feed_shape(feed: dict[str, np.ndarray]) -> tuple[int, int]:
    """A batch's rows and the length each is padded to (an image row: IMAGE_ROW_TOKENS)."""
    if PIXEL_VALUES in feed:
        return len(feed[PIXEL_VALUES]), IMAGE_ROW_TOKENS
    rows, length = feed["input_ids"].shape
    return rows, length


def _pixel_feed(groups: list[Group]) -> tuple[dict[str, np.ndarray], int]:
    """The batch's images, stacked in batch order; and what they count as tokens."""
    blocks = []
    for group in groups:
        pixels = group.item.rows.pixel_values
        blocks.append(pixels if len(group.rows) == len(pixels) else pixels[group.rows])
    stacked = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    return {PIXEL_VALUES: stacked}, len(stacked) * IMAGE_ROW_TOKENS


def request_outputs(group: Group, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A request's outputs from the one batch that carried all of its rows, in its order."""
    item, count, start = group.item, len(group.rows), group.start
    outputs = {}
    for name in item.outputs:
        block = results[name][start : start + count]
        outputs[name] = block if block.ndim == 2 else _own(block, item, group.rows)
    return outputs


def place_outputs(group: Group, results: dict[str, np.ndarray]) -> None:
    """Copy a request's rows of this batch into its outputs being filled in (`item.results`, made on first use)."""
    item, count, start = group.item, len(group.rows), group.start
    if item.results is None:
        item.results = {name: _empty(results[name], item) for name in item.outputs}
    for name, own in item.results.items():
        block = results[name][start : start + count]
        if own.ndim == 2:
            own[group.rows] = block
        else:
            for position, row in enumerate(group.rows):
                length = item.lengths[row]
                own[row, :length] = block[position, :length]


def _each_row(groups: list[Group], name: str, default: int) -> Iterator[np.ndarray]:
    """Each row's values of one optional per-token array, in batch order (`default` where a request has none)."""
    for group in groups:
        item = group.item
        values = getattr(item.rows, name)
        for row in group.rows:
            start, length = item.starts[row], item.lengths[row]
            yield np.full(length, default, np.int64) if values is None else values[start : start + length]


def _laid_out(tokens: np.ndarray, kept: np.ndarray | None, shape: tuple[int, int], fill: int) -> np.ndarray:
    """Rows' values laid end to end, as a [rows, length] array: `fill` where `kept` is False (None: kept everywhere)."""
    if kept is None:
        return tokens.reshape(shape)
    array = np.full(shape, fill, dtype=np.int64)
    array[kept] = tokens
    return array


def _empty(like: np.ndarray, item: WorkItem) -> np.ndarray:
    """A request's output array: per row, or per row and position up to its width (zeros past each row's end)."""
    rows = item.rows.rows
    if like.ndim == 2:
        return np.empty((rows, like.shape[1]), like.dtype)
    return np.zeros((rows, item.rows.width, like.shape[2]), like.dtype)


def _own(block: np.ndarray, item: WorkItem, rows: list[int]) -> np.ndarray:
    """A request's whole per-position output from its block of the batch (zeros past each row's end)."""
    width = item.rows.width
    if block.shape[1] >= width and all(length == width for length in item.lengths):
        return block[:, :width]
    own = _empty(block, item)
    for position, row in enumerate(rows):
        length = item.lengths[row]
        own[row, :length] = block[position, :length]
    return own
