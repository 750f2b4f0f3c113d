"""What a task head is, as each head module declares it at its end (export.heads.registry lists them).

A declaration carries everything the exporter asks of a head: whether a folder is its, how it reads
the folder's head and weights, how it wraps the encoder, its graph outputs, its config.pbtxt
parameters, the variants it is not gated in, and the library checks beyond sentence-transformers'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from torch import Tensor, nn

from export.gate.references.loop import VariantCheck
from service.core.text_rules import PairTemplate

if TYPE_CHECKING:  # the checkpoint and the gate read heads; heads name them in annotations only
    from export.checkpoints.checkpoint import Checkpoint
    from export.checkpoints.sentence_transformers_folder import Declarations
    from export.families.family import EncoderSettings
    from service.pipeline.tokenizer import TextTokenizer

SEQUENCE = "sequence"
"""The dynamic sequence axis of an output."""


class HeadConfiguration(Protocol):
    """What every head's configuration is: plain data parity.json records."""

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        ...


class UnreadableHead(ValueError):
    """A folder whose head cannot be read; the message names the file or field (each head's errors are these)."""


@dataclass(frozen=True)
class HeadFolder:
    """What a source folder says before its weights are read: enough to tell whose head it is."""

    folder: Path
    hf_config: dict
    """config.json."""
    task: str
    """The task sentence-transformers' files (or config.json's architectures) give the folder."""
    declarations: Declarations
    """What its sentence-transformers modules declare."""


@dataclass(frozen=True)
class HeadWeights:
    """The weights a head is read from, beside the encoder's."""

    model_type: str
    """The encoder's family (config.json model_type, as the family reads it)."""
    d_model: int
    encoder: dict[str, Tensor]
    """The encoder's weights, checked, in fp32."""
    rest: dict[str, Tensor]
    """The checkpoint's weights the family set apart as task-head weights."""
    read_file: Callable[[Path], dict[str, Tensor]]
    """A module folder -> its weights (model.safetensors or pytorch_model.bin)."""


@dataclass(frozen=True)
class GraphOutput:
    """One output of the exported graph: its name and its axes after the batch axis."""

    name: str
    dims: tuple[int | str, ...]
    """A fixed width, or SEQUENCE for the dynamic sequence axis."""


def embedder_outputs(config: EncoderSettings) -> tuple[GraphOutput, ...]:
    """A plain embedder's outputs: every position's hidden state and the pooled embedding."""
    return (
        GraphOutput("last_hidden_state", (SEQUENCE, config.d_model)),
        GraphOutput("embedding", (config.d_model,)),
    )


class Ungated(NamedTuple):
    """Variants a head's outputs are not gated in (never published), and why."""

    variants: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ReferenceInputs:
    """What a library check is given: the checkpoint, the server's tokenizer and graph inputs, and the gate texts."""

    checkpoint: Checkpoint
    tokenizer: TextTokenizer | None
    input_names: list[str]
    sentences: list[str]


@dataclass(frozen=True)
class LibraryStep:
    """What a head's further library check says of itself: its stage, its library and where its figures go."""

    stage: str
    """The export stage it is announced as."""
    library: str
    """The library, as a refusal names it ("FlagEmbedding refused: ...")."""
    report_key: str
    """Where parity.json keeps its figures."""
    needs_tokenizer: bool
    """Run only when the server tokenises (the check feeds texts)."""

    def runs(self, with_tokenizer: bool) -> bool:
        """Whether it runs for a model with (or without) a tokenizer."""
        return with_tokenizer or not self.needs_tokenizer


@dataclass(frozen=True)
class Reference(LibraryStep):
    """A library every published variant is also held to, after the reference library (bge-m3's FlagEmbedding).

    Its figures go under each variant in parity.json.
    """

    answers: Callable[[ReferenceInputs], VariantCheck]
    """Runs the library on the folder now (before our model is built; its model is let go after) -> the check each
    published variant is held to while its session is open."""


@dataclass(frozen=True)
class ModelReference(LibraryStep):
    """A library the PyTorch model itself is held to (SPLADE's masked LM): one set of figures at parity.json's top."""

    check: Callable[[ReferenceInputs, nn.Module], tuple[dict[str, object], list[str]]]
    """(inputs, the PyTorch model, while it is built) -> (figures, failures)."""


LibraryCheck = Callable[..., VariantCheck]
"""(checkpoint, tokenizer, input names, sentences) -> the check each published variant is held to (the library runs on
the folder when this is called, and only its answers are kept)."""


def _no_parameters(head: Any) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Head:
    """A task head: what it is, how it is read and built, what it outputs, and how it is checked."""

    name: str
    config_type: type
    """The head's configuration class (one head a class)."""
    task: str
    """The served task: "embed", "classify", "sparse" or "multivector"."""
    claims: Callable[[HeadFolder], bool]
    """Whether a folder's head is this one (HEADS is asked in order; raises UnreadableHead for a broken one)."""
    read: Callable[[HeadFolder, HeadWeights], tuple[Any, dict[str, Tensor]]]
    """-> (the head's configuration, its weights under the wrapped model's head names); raises UnreadableHead."""
    wrap: Callable[[nn.Module, Any], nn.Module]
    """(encoder, the head's configuration) -> the model answering the head's outputs."""
    outputs: Callable[[EncoderSettings, Any], tuple[GraphOutput, ...]]
    """(encoder settings, the head's configuration) -> the graph's outputs, in the wrapped model's order."""
    parameters: Callable[[Any], dict[str, str]] = _no_parameters
    """The head's configuration -> its config.pbtxt parameters (beyond its task's)."""
    scores_pairs: Callable[[Path, dict], bool] | None = None
    """(folder, config.json) -> whether config.json alone makes the folder a pair scorer (task classify)."""
    pooling: Callable[[HeadFolder], tuple[str, bool]] | None = None
    """The encoder's pooling and normalisation the head needs (None: what the folder declares)."""
    pair_template: PairTemplate | None = None
    """How a pair becomes one prompted sequence (None: the tokenizer's pair form)."""
    ungated: Ungated | None = None
    """The variants its outputs are not gated in; None: every variant is."""
    library_check: LibraryCheck | None = None
    """The check that replaces sentence-transformers' when the server tokenises (None: sentence-transformers')."""
    library_stage: str | None = None
    """How library_check's stage is announced (None: as sentence-transformers')."""
    references: tuple[Reference, ...] = ()
    """Libraries every published variant is also held to, after the reference library."""
    model_references: tuple[ModelReference, ...] = ()
    """Libraries the PyTorch model is held to."""
