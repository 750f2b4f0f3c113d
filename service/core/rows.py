"""Rows and their requests, as the batcher takes them and hands them back.

The engine batches rows, not requests: a row keeps its own length until the batch it joins is
padded to that batch's longest. A request's rows travel as a few flat arrays (`TokenRows`, cheap
to hand to another thread or process): the ids of every row one after another, and each row's
length. In the queue a request is a `WorkItem` (its rows, those still waiting for a batch, who is
told when it settles); it is answered with a `WorkResult` (its own rows of each output, in its
order, and where its time went).

Images ride the same queue as `PixelRows`: each row an image's preprocessed pixel values, every row of a model
the same shape. An image row counts as one token (IMAGE_ROW_TOKENS) wherever rows are budgeted by tokens: an
image tower's batches are bounded by their rows (`max_batch_size`), and its queue by rows and requests.

Right padding carries no meaning, so it is dropped: a row ends at its last attended token. A
mask with zeros before that (left padding, holes) changes what the model computes — positions
count from the row's first slot — so such rows keep their slots and their mask.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

_INT64 = np.int64


class TokenRows(msgspec.Struct, gc=False):
    """Token sequences of one request: the ids of every row concatenated, and each row's length.

    A msgspec Struct: built in C, at a quarter of a dataclass's cost (one per request on the engine's loop).
    """

    input_ids: np.ndarray
    """int64 [sum of lengths]."""
    lengths: np.ndarray
    """int64 [rows]: each row's length, up to and including its last attended token (or its last expansion
    token: a late-interaction query's unattended tokens whose vectors are kept)."""
    width: int
    """The request's own padded length: last_hidden_state is [rows, width, hidden]."""
    attention_mask: np.ndarray | None = None
    """int64 [sum of lengths], or None when every token of every row attends."""
    token_type_ids: np.ndarray | None = None
    """int64 [sum of lengths], or None when every segment id is 0."""
    adapter_ids: np.ndarray | None = None
    """int64 [sum of lengths]: each token's task adapter (a model with task adapters), or None when every one is 0
    (none)."""

    @property
    def rows(self) -> int:
        """Sequences in the request."""
        return len(self.lengths)

    @property
    def real_tokens(self) -> int:
        """Attended tokens of all rows (special tokens included)."""
        if self.attention_mask is None:
            return len(self.input_ids)
        return int(np.count_nonzero(self.attention_mask))

    @classmethod
    def from_padded(cls, tokens: dict[str, np.ndarray]) -> TokenRows:
        """Rows from [rows, length] arrays (input_ids, attention_mask[, token_type_ids][, adapter_ids]), unpadded.

        Right padding is dropped. The request's width stays the arrays' length. The mask is kept only
        where some row has a zero before its last attended token; the segment and adapter ids only
        where one of them is not 0.
        """
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        width = ids.shape[1]
        attended = mask != 0
        # Each row ends after its last attended token (rows attend to at least one: validation checks).
        lengths = (width - np.argmax(attended[:, ::-1], axis=1)).astype(_INT64)
        kept = np.arange(width) < lengths[:, None]
        needs_mask = bool((np.count_nonzero(attended, axis=1) != lengths).any())
        types, adapters = (_nonzero(tokens.get(name), kept) for name in ("token_type_ids", "adapter_ids"))
        return cls(
            input_ids=np.ascontiguousarray(ids[kept], dtype=_INT64),
            lengths=lengths,
            width=width,
            attention_mask=np.ascontiguousarray(mask[kept], dtype=_INT64) if needs_mask else None,
            token_type_ids=types,
            adapter_ids=adapters,
        )

    def joined(self, other: TokenRows) -> TokenRows:
        """These rows, then `other`'s, as one request's rows."""

        def both(name: str, default: int) -> np.ndarray | None:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                return None
            mine = np.full(len(self.input_ids), default, _INT64) if mine is None else mine
            theirs = np.full(len(other.input_ids), default, _INT64) if theirs is None else theirs
            return np.concatenate([mine, theirs])

        return TokenRows(
            np.concatenate([self.input_ids, other.input_ids]),
            np.concatenate([self.lengths, other.lengths]),
            max(self.width, other.width),
            both("attention_mask", 1),
            both("token_type_ids", 0),
            both("adapter_ids", 0),
        )

    def split(self, first: int) -> tuple[TokenRows, TokenRows]:
        """The first `first` rows, and the rest (each keeping this request's width)."""
        cut = int(self.lengths[:first].sum())
        parts = []
        for rows, tokens in ((slice(None, first), slice(None, cut)), (slice(first, None), slice(cut, None))):
            mask, types, adapters = self.attention_mask, self.token_type_ids, self.adapter_ids
            parts.append(
                TokenRows(
                    self.input_ids[tokens],
                    self.lengths[rows],
                    self.width,
                    None if mask is None else mask[tokens],
                    None if types is None else types[tokens],
                    None if adapters is None else adapters[tokens],
                )
            )
        return parts[0], parts[1]

    def padded(self, pad_token_id: int = 0) -> dict[str, np.ndarray]:
        """The rows as [rows, width] arrays, right-padded (the form the model and the fidelity check take)."""
        kept = np.arange(self.width) < self.lengths[:, None]
        ids = np.full((self.rows, self.width), pad_token_id, dtype=_INT64)
        ids[kept] = self.input_ids
        mask = kept.astype(_INT64)
        if self.attention_mask is not None:
            mask[kept] = self.attention_mask
        padded = {"input_ids": ids, "attention_mask": mask}
        for name in ("token_type_ids", "adapter_ids"):
            padded[name] = np.zeros((self.rows, self.width), dtype=_INT64)
            if getattr(self, name) is not None:
                padded[name][kept] = getattr(self, name)
        return padded

    def with_adapter(self, adapter_id: int) -> TokenRows:
        """These rows with every token on one task adapter (0: none)."""
        adapters = np.full(len(self.input_ids), adapter_id, _INT64) if adapter_id else None
        return TokenRows(self.input_ids, self.lengths, self.width, self.attention_mask, self.token_type_ids, adapters)


IMAGE_ROW_TOKENS = 1
"""What one image row counts as where rows are budgeted by tokens (batch and queue budgets, usage)."""


class PixelRows(msgspec.Struct, gc=False):
    """Images of one request, preprocessed: each row one image's float32 pixel values [channels, height, width]."""

    pixel_values: np.ndarray
    """float32 [rows, channels, height, width]."""

    @property
    def rows(self) -> int:
        """Images in the request."""
        return len(self.pixel_values)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [rows]: each image row's length as the batcher reads it (IMAGE_ROW_TOKENS)."""
        return np.full(self.rows, IMAGE_ROW_TOKENS, _INT64)

    @property
    def width(self) -> int:
        """An image row's one position."""
        return IMAGE_ROW_TOKENS

    @property
    def real_tokens(self) -> int:
        """What the request's images count as tokens (IMAGE_ROW_TOKENS each)."""
        return self.rows * IMAGE_ROW_TOKENS


Rows = TokenRows | PixelRows
"""A request's rows as the batcher takes them: token sequences, or images (each model queue holds one kind)."""


def _nonzero(values: np.ndarray | None, kept: np.ndarray) -> np.ndarray | None:
    """An optional per-token array's kept values, or None where there is none or every value is 0."""
    if values is None or not values.any():
        return None
    return np.ascontiguousarray(values[kept], dtype=_INT64)


class WorkResult(msgspec.Struct, gc=False):
    """A request's own rows of each requested output, in its order, and where its time went.

    A msgspec Struct: built in C, at a third of a dataclass's cost (one per request on the loop).
    """

    outputs: dict[str, np.ndarray]
    queue_s: float
    """Time in the batcher not spent running its batches."""
    compute_s: float
    """Run time of the batches its rows rode in."""
    batch_rows: int
    """Rows of the largest batch it rode in."""


class Share(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Whose rows a request's are, and the priority they wait at: what orders them in the queue."""

    priority: int = 1
    """1 the highest, up to the model's priority levels."""
    tenant: str = ""
    """Whose request it is ("" without API keys): tenants of one priority share the engine by weight."""
    weight: float = 1.0
    """The tenant's weight in that share."""


DEFAULT_SHARE = Share()
"""A request with no priority, tenant or weight of its own."""


Done = Callable[["WorkItem", "WorkResult | None", "Exception | None"], None]
"""Told a settled request: its result, or its error."""


class WorkItem:
    """One queued request: its rows (tokens or images), those waiting for a batch, who is told when it settles."""

    __slots__ = (
        "_settled",
        "batch_rows",
        "compute_s",
        "deadline",
        "enqueued_at",
        "expiry",
        "future",
        "lengths",
        "on_done",
        "outputs",
        "owner",
        "results",
        "rows",
        "sequence",
        "share",
        "start_tag",
        "starts",
        "trace",
        "unanswered",
        "waiting",
    )

    def __init__(
        self,
        rows: Rows,
        outputs: tuple[str, ...],
        future: asyncio.Future[WorkResult] | None,
        deadline: float | None,
        trace: SpanContext | None = None,
        *,
        share: Share = DEFAULT_SHARE,
    ) -> None:
        self.rows = rows
        self.share = share
        """Its priority and whose it is: where it waits in the queue (service.core.schedule)."""
        self.start_tag = 0.0
        """Its turn among its level's tenants (service.core.schedule)."""
        self.sequence = 0
        """Its place in arrival order, among equal turns."""
        self.trace = trace
        """The request's span context (while tracing is on): its batches' spans link to it."""
        self.outputs = outputs
        self.future = future
        """What an awaiting caller waits on (None for callers told by `on_done`)."""
        self._settled = False
        self.deadline = deadline
        self.enqueued_at = time.monotonic()
        self.lengths: list[int] = rows.lengths.tolist()
        self.waiting: list[int]
        """Rows not yet in a batch, shortest first (the longest is taken next)."""
        if len(self.lengths) == 1:  # most requests: one text
            self.starts: list[int] = [0]
            self.waiting = [0]
        else:
            self.starts = [0, *itertools.accumulate(self.lengths[:-1])]
            self.waiting = np.argsort(rows.lengths, kind="stable").tolist()
        self.unanswered = len(self.lengths)
        """Rows not yet back from a run."""
        self.results: dict[str, np.ndarray] | None = None
        """The outputs being filled in, once rows come back from more than one batch."""
        self.compute_s = 0.0
        self.batch_rows = 0
        self.expiry: asyncio.TimerHandle | None = None
        """The timer that fails the request at its deadline, while it has rows waiting."""
        self.on_done: Done | None = None
        """Told (on the loop, at once) the result or error the request is settled with; None: await `future`."""
        self.owner: object = None
        """The caller's own note of whose request this is (the batcher never reads it)."""

    def resolve(self, result: WorkResult | None, error: Exception | None = None) -> None:
        """Settle the request: its result or its error; its expiry timer, its future and `on_done` follow."""
        self._settled = True
        if self.expiry is not None:
            self.expiry.cancel()
        if self.future is not None:
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        if self.on_done is not None:
            self.on_done(self, result, error)

    @property
    def settled(self) -> bool:
        """Answered, failed or cancelled (its awaiting caller gone counts): its rows are never answered again."""
        return self._settled or (self.future is not None and self.future.done())

    def cancel(self) -> None:
        """The caller went away: settled, without an answer."""
        self._settled = True
        if self.expiry is not None:
            self.expiry.cancel()
        if self.future is not None:
            self.future.cancel()

    @property
    def next_length(self) -> int:
        """Length of the longest waiting row."""
        return self.lengths[self.waiting[-1]]
