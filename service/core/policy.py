"""The batching policy: the limits that shape batches and the queue, and which waiting rows make the next batch.

A batch starts from the longest waiting row of the request at the head of the queue, then takes the
waiting rows nearest its length (older requests first among equals), up to `max_batch_size` rows
and `max_batch_tokens` padded tokens (rows x the batch's longest), none of them padded far past its
own length (the policy's padding factor and slack). `batching_policy` says which limits are in
force for a model on its device (the settings, else its config.pbtxt, else the device's defaults),
and `warm_up_shapes` which batch shapes to run before serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.core.repository import ModelSpec, RepositoryError
from service.core.rows import WorkItem
from service.ops.settings import Settings

SELECTION_WINDOW_BATCHES = 2
"""A batch is chosen among the waiting rows of the queue's first requests, up to this many batches' worth."""


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
    """Requests waiting (at a new request's priority or higher) before it is rejected."""
    max_queue_rows: int = 0
    """Rows waiting (at a new request's priority or higher) before it is rejected; 0 = no such bound."""
    max_queue_tokens: int = 0
    """Tokens of the rows waiting (at a new request's priority or higher) before it is rejected; 0 = no such bound."""
    max_queue_wait_ms: int = 0
    """Expected wait (the rows waiting at a new request's priority or higher, over the model's measured rows per
    second) past which it is rejected; 0 = no such bound."""
    priority_levels: int = 1
    """Priorities a request may wait at, 1 the highest (Triton's priority_levels)."""
    default_priority: int = 1
    """The priority of a request that names none and whose tenant sets none."""
    min_lower_priority_share: float = 0.1
    """While a lower priority has rows waiting, at least this share of batches is its (0: strict priority)."""
    express_lane: bool = False
    """A batch of the highest priority starts at once beside lower-priority batches that hold every instance."""
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


DEFAULT_PRIORITY_LEVELS = 2
"""Priorities of a model whose settings and config.pbtxt name none: 1 for interactive requests (the default),
2 for bulk work (the ingestion client's default)."""

# Defaults that depend on the device (settings of 0 mean "auto").
CUDA_LENGTH_BUCKET = 32
CPU_MAX_BATCH_TOKENS = 4096
CUDA_MAX_BATCH_TOKENS = 16384
CPU_PADDING = (1.25, 16)
"""On the CPU no row is padded past 1.25 times its own length or its length plus 16 tokens, whichever
is more: a CPU's run costs about rows x padded length, plus little per batch
(docs/decisions.md#padding-limits-per-device)."""
CUDA_PADDING = (2.0, 32)
"""On CUDA rows may be padded to twice their length (or plus 32 tokens): a GPU's fixed cost per batch
is larger against its cost per token (docs/decisions.md#padding-limits-per-device)."""


def batching_policy(spec: ModelSpec, settings: Settings, device: str) -> BatchingPolicy:
    """The batching limits in force: the settings where given, else the model's config.pbtxt and device defaults."""
    batching = spec.config.dynamic_batching
    delay_us = (
        settings.max_queue_delay_us if settings.max_queue_delay_us >= 0 else batching.max_queue_delay_microseconds
    )
    padding = CUDA_PADDING if device == "cuda" else CPU_PADDING
    levels = settings.priority_levels or batching.priority_levels or DEFAULT_PRIORITY_LEVELS
    default_priority = settings.default_priority or batching.default_priority_level or 1
    if default_priority > levels:
        raise RepositoryError(
            f"{spec.name}: the default priority {default_priority} is not one of its {levels} priority levels"
            " (--default-priority, or default_priority_level in config.pbtxt)"
        )
    return BatchingPolicy(
        max_batch_size=settings.max_batch_size or spec.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens
        or (CUDA_MAX_BATCH_TOKENS if device == "cuda" else CPU_MAX_BATCH_TOKENS),
        max_queue_delay_s=delay_us / 1e6,
        max_queue_size=settings.max_queue_size or batching.default_queue_policy.max_queue_size or 1024,
        max_queue_rows=settings.max_queue_rows,
        max_queue_tokens=settings.max_queue_tokens,
        max_queue_wait_ms=settings.max_queue_wait_ms,
        priority_levels=levels,
        default_priority=default_priority,
        min_lower_priority_share=settings.min_lower_priority_share,
        express_lane=settings.express_lane and levels > 1,
        length_bucket=_length_bucket(spec, settings, device),
        pad_token_id=spec.pad_token_id,
        max_batch_run_s=settings.max_batch_run_s,
        max_length=spec.max_sequence_length,
        max_padding_factor=padding[0],
        padding_slack_tokens=padding[1],
    )


def _length_bucket(spec: ModelSpec, settings: Settings, device: str) -> int:
    """What batch lengths are rounded up to: the settings', else the device's.

    A model that reads its texts padded to its max_sequence_length (SigLIP: text_padding max_length) has every
    batch padded so.
    """
    if spec.text_padding == "max_length":
        return spec.max_sequence_length
    return settings.length_bucket or (CUDA_LENGTH_BUCKET if device == "cuda" else 1)


def warm_up_shapes(spec: ModelSpec, policy: BatchingPolicy) -> list[tuple[int, int]]:
    """(rows, length) shapes the batcher can form: every bucketed length, then the largest batch.

    Without length buckets (CPU) a short batch stands for the lengths. The largest batch, by
    memory, is the longest length with as many rows as the token budget allows there (a batch of
    longer rows holds fewer of them; a single row is always allowed).
    """
    longest = spec.max_sequence_length
    if policy.length_bucket > 1:
        lengths = sorted({policy.padded_length(n) for n in range(1, longest + 1, policy.length_bucket)})
    else:
        lengths = [min(8, longest)]
    widest = policy.padded_length(longest)
    largest_rows = max(1, min(policy.max_batch_size, policy.max_batch_tokens // widest))
    return [(1, length) for length in lengths] + [(largest_rows, widest)]
