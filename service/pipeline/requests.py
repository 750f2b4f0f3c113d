"""What a request is on its way through the pipeline: as a front end received it, and as checked against its model.

An `InputTensor` is an input unchecked (service.pipeline.api's `InferenceRequest` carries them);
service.pipeline.validation checks them against a model's `ModelSignature` into a `ValidRequest`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from service.core.repository import ModelSpec
from service.core.rows import TokenRows
from service.pipeline.multivector import DOCUMENT
from service.pipeline.outputs import ServedOutput, asks_for_tokens, served_outputs
from service.pipeline.vocabulary import IMAGE_INPUT, QUERY_INPUT, TEXT_INPUT


@dataclass(slots=True)
class InputTensor:
    """One input as a front end received it: declared name, datatype and shape, and its data, unchecked."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | Sequence[bytes] | Sequence[int]
    """Raw contents (`raw`: little-endian; BYTES as a 4-byte length then the bytes, per element), or the
    typed values themselves."""
    raw: bool


@dataclass(frozen=True)
class RowLimit:
    """A front end's own bound on the rows of one request (without one, the model's max_batch_size)."""

    rows: int
    setting: str
    """The flag that sets it, named in the refusal."""


@dataclass(frozen=True)
class TextLimits:
    """Bounds on the text one request may carry, checked before any tokenisation."""

    max_text_bytes: int = 64 * 1024
    """One text, UTF-8 bytes (--max-text-bytes)."""
    max_request_text_bytes: int = 1024 * 1024
    """All texts of a request together, UTF-8 bytes (--max-request-text-bytes)."""


@dataclass(frozen=True)
class ModelSignature:
    """What a model accepts, as requests are checked against it."""

    spec: ModelSpec
    accepts_text: bool
    max_batch_size: int
    text_limits: TextLimits = TextLimits()
    priority_levels: int = 1
    """Priorities a request may ask for (1 the highest)."""
    max_image_bytes: int = 20 * 1024 * 1024
    """One encoded image, bytes (--max-image-bytes)."""

    @property
    def accepts_images(self) -> bool:
        """Whether the model has an image tower (input image)."""
        return bool(self.spec.image_variants)

    @functools.cached_property
    def input_datatypes(self) -> dict[str, str]:
        """Accepted input name -> KServe datatype (built once: every request is checked against it)."""
        names = {name: "INT64" for name in self.spec.input_names}
        if self.accepts_text:
            names[TEXT_INPUT] = "BYTES"
            if self.spec.task == "classify" or self.spec.multivector is not None:
                names[QUERY_INPUT] = "BYTES"
        if self.accepts_images:
            names[IMAGE_INPUT] = "BYTES"
        return names

    @functools.cached_property
    def outputs(self) -> dict[str, ServedOutput]:
        """Every output the model answers, by name: the graph's and the forms made from them (built once)."""
        return served_outputs(self.spec, self.accepts_text)


@dataclass(slots=True)
class ValidRequest:
    """A request checked against its model: texts to tokenise, token rows, or images; what to answer with."""

    texts: list[str] | None
    """Texts, each with the prompt's prefix already put before it."""
    tokens: TokenRows | None
    outputs: tuple[str, ...]
    """Requested outputs, in the order they are to be returned."""
    timeout_s: float | None
    """Triton's per-request `timeout` parameter, when given."""
    queries: list[str] | None = None
    """The pairs' first members (row i is (queries[i], texts[i])); None: single texts."""
    truncate: bool = True
    """False: a sequence longer than the model's maximum is not cut: an embedder's text is embedded in windows
    (service.pipeline.long_texts), a classifier's refused."""
    dimensions: int | None = None
    """The embedding width to answer with (a Matryoshka width); None: the model's own."""
    top_k: int | None = None
    """A sparse embedding's terms to keep per row, the largest; None: every non-zero term."""
    input_type: str = DOCUMENT
    """Whether a multi-vector model's texts are queries or documents (service.pipeline.multivector)."""
    late_chunking: bool = False
    """The texts are consecutive chunks of one document, embedded in its context (service.pipeline.long_texts)."""
    instruction: str | None = None
    """The pair template's instruction for these pairs; None: the template's default."""
    adapter_id: int = 0
    """The task adapter every row runs with (1 + its place in the model's adapter_tasks; 0: none, or the token
    request's own adapter_ids)."""
    add_special_tokens: bool = True
    """Whether the token outputs hold the model's special tokens."""
    priority: int = 0
    """The priority asked for (1 the highest); 0: its tenant's, else the model's default."""
    images: list[bytes] | None = None
    """Encoded images, each checked for its size only (decoded on a worker: service.pipeline.images); None: no
    images (texts or token rows)."""

    @property
    def tokens_only(self) -> bool:
        """The request asks for the texts' tokens (vocabulary.TOKEN_OUTPUTS): the model does not run."""
        return asks_for_tokens(self.outputs)

    @property
    def rows(self) -> int:
        """Sequences in the request."""
        if self.images is not None:
            return len(self.images)
        return len(self.texts) if self.texts is not None else self.tokens.rows
