"""bge-m3: one XLM-RoBERTa encoder with three outputs from one forward pass (dense, sparse, ColBERT).

FlagEmbedding's `BGEM3FlagModel` saves the transformer as usual and its two heads beside it:
`colbert_linear.pt` (a Linear hidden -> ColBERT width) and `sparse_linear.pt` (a Linear hidden -> 1).
From the last hidden states it makes
- the dense embedding: the first position ([CLS]/<s>), L2-normalised;
- ColBERT vectors: colbert_linear on positions 1.. (zeroed outside the attention mask), each L2-normalised;
- token weights: relu(sparse_linear) per position; a text's term weight is the largest weight of its id,
  leaving out the ids of the tokenizer's cls, eos, pad and unk tokens (its `unused_tokens`).
The graph answers every position's ColBERT vector ([CLS] included: the server drops the first
position and positions outside the mask) and every position's weight, 0 at those special ids and
outside the mask; the server takes each id's largest weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from export.checkpoints.sentence_transformers_folder import FolderError, read_object
from export.families.family import EncoderSettings
from export.gate.references import bge_m3 as flag_embedding
from export.gate.references import library
from export.gate.references.loop import VariantCheck, unchecked
from export.heads.head import (
    SEQUENCE,
    GraphOutput,
    Head,
    HeadFolder,
    HeadWeights,
    Reference,
    ReferenceInputs,
    Ungated,
    UnreadableHead,
    embedder_outputs,
)
from export.layers.pooling import pool
from service.core.repository import P_MULTIVECTOR, TOKEN_VECTORS, TOKEN_WEIGHTS
from service.core.text_rules import MultiVectorSpec

if TYPE_CHECKING:
    from export.checkpoints.checkpoint import Checkpoint
    from service.pipeline.tokenizer import TextTokenizer

COLBERT_HEAD_FILE = "colbert_linear.pt"
SPARSE_HEAD_FILE = "sparse_linear.pt"
MODEL_TYPE = "xlm-roberta"
OUTPUT_NAMES = ("last_hidden_state", "embedding", TOKEN_VECTORS, TOKEN_WEIGHTS)
UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")
"""The special tokens whose ids FlagEmbedding leaves out of a text's term weights."""
DENSE_POOLING = ("cls", True)
"""FlagEmbedding's dense embedding: the first position, normalised (BGEM3FlagModel's defaults)."""
MULTIVECTOR = MultiVectorSpec(score="mean", skip_first_token=True)
"""FlagEmbedding's ColBERT rule: the first position's vector dropped, MaxSim averaged over the query's vectors."""


class BgeM3Error(UnreadableHead):
    """A bge-m3 folder whose heads or tokenizer cannot be read as FlagEmbedding reads them; the message names it."""


@dataclass(frozen=True)
class BgeM3Config:
    """bge-m3's heads: the ColBERT vectors' width and the token ids left out of the term weights."""

    colbert_width: int
    unused_token_ids: tuple[int, ...]

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {
            "style": "bge-m3",
            "dense": "first position, L2-normalised",
            "colbert_width": self.colbert_width,
            "unused_token_ids": list(self.unused_token_ids),
            "multivector": MULTIVECTOR.to_json(),
        }


def has_heads(folder: Path) -> bool:
    """Whether a folder holds bge-m3's two head files; one without the other is refused."""
    present = [(folder / name).is_file() for name in (COLBERT_HEAD_FILE, SPARSE_HEAD_FILE)]
    if any(present) and not all(present):
        found, missing = (COLBERT_HEAD_FILE, SPARSE_HEAD_FILE) if present[0] else (SPARSE_HEAD_FILE, COLBERT_HEAD_FILE)
        raise BgeM3Error(f"{folder}: {found} without {missing}: a bge-m3 folder has both of FlagEmbedding's heads")
    return all(present)


def _linear(path: Path, d_model: int, width: int | None) -> dict[str, Tensor]:
    """A saved nn.Linear state dict (weight [width, d_model], bias [width]), checked; width None: any."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise BgeM3Error(f"{path}: unreadable ({error})") from error
    if not isinstance(state, dict) or set(state) != {"weight", "bias"}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise BgeM3Error(f"{path}: not a Linear layer's weight and bias (holds {keys})")
    weight, bias = state["weight"], state["bias"]
    rows = weight.shape[0] if weight.dim() == 2 else -1
    wanted = width or rows
    if weight.dim() != 2 or weight.shape[1] != d_model or rows != wanted or tuple(bias.shape) != (rows,) or rows <= 0:
        expected = f"[{width or 'width'}, {d_model}] and bias [{width or 'width'}]"
        raise BgeM3Error(
            f"{path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)}, the model needs weight {expected}"
        )
    return {"weight": weight.to(torch.float32), "bias": bias.to(torch.float32)}


def read_heads(folder: Path, d_model: int) -> tuple[int, dict[str, Tensor]]:
    """The ColBERT width and both heads' weights under BgeM3Heads' names, checked against the hidden size."""
    colbert = _linear(folder / COLBERT_HEAD_FILE, d_model, None)
    sparse = _linear(folder / SPARSE_HEAD_FILE, d_model, 1)
    weights = {f"colbert.{k}": v for k, v in colbert.items()} | {f"sparse.{k}": v for k, v in sparse.items()}
    return colbert["weight"].shape[0], weights


def _token_content(value: object) -> str | None:
    """A special token as tokenizer files write it: its text, or an AddedToken object with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def unused_token_ids(folder: Path) -> tuple[int, ...]:
    """The ids of the cls, eos, pad and unk tokens the folder's tokenizer files declare (as transformers reads them)."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise BgeM3Error(f"{folder}: no tokenizer.json (bge-m3's term weights leave out its special tokens' ids)")
    declared: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            settings = read_object(path)
        except FolderError as error:
            raise BgeM3Error(str(error)) from error
        for key in UNUSED_TOKENS:
            content = _token_content(settings.get(key))
            if content is None:
                continue
            if declared.setdefault(key, content) != content:
                raise BgeM3Error(f"{path}: {key} {content!r} differs from {declared[key]!r} in tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = set()
    for key, content in declared.items():
        token_id = tokenizer.token_to_id(content)
        if token_id is None:
            raise BgeM3Error(f"{tokenizer_file}: {key} {content!r} is not in the vocabulary")
        ids.add(token_id)
    return tuple(sorted(ids))


class BgeM3Heads(nn.Module):
    """bge-m3's ColBERT and sparse heads on the last hidden states: every position's vector and weight."""

    def __init__(self, d_model: int, heads: BgeM3Config) -> None:
        super().__init__()
        self.colbert = nn.Linear(d_model, heads.colbert_width)
        self.sparse = nn.Linear(d_model, 1)
        self.register_buffer(
            "unused_token_ids", torch.tensor(heads.unused_token_ids, dtype=torch.int64), persistent=False
        )

    def forward(self, hidden: Tensor, mask: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """token_vectors [b, s, width] and token_weights [b, s, 1] from hidden states [b, s, d] and the float mask.

        Vectors are L2-normalised and 0 outside the mask; weights are 0 outside the mask and at the left-out ids.
        """
        vectors = F.normalize(self.colbert(hidden) * mask.unsqueeze(-1), p=2.0, dim=-1)
        weights = torch.relu(self.sparse(hidden)) * mask.unsqueeze(-1)
        if self.unused_token_ids.numel():
            kept = (input_ids.unsqueeze(-1) != self.unused_token_ids).all(dim=-1, keepdim=True)
            weights = weights * kept.to(weights.dtype)
        return vectors, weights


class BgeM3Encoder(nn.Module):
    """The encoder and bge-m3's heads: (input_ids, attention_mask) -> hidden states, embedding, vectors, weights."""

    output_names = OUTPUT_NAMES

    def __init__(self, encoder: nn.Module, heads: BgeM3Config) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = heads
        self.encoder = encoder
        self.head = BgeM3Heads(encoder.config.d_model, heads)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """last_hidden_state [b, s, d], embedding [b, d], token_vectors [b, s, width], token_weights [b, s, 1]."""
        hidden, mask = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        embedding = pool(hidden, mask, self.config.pooling, self.config.normalize)
        return hidden, embedding, *self.head(hidden, mask, input_ids)


def _claims(source: HeadFolder) -> bool:
    """Whether the folder is bge-m3 (an XLM-RoBERTa embedder with FlagEmbedding's two head files), checked."""
    heads = has_heads(source.folder)
    model_type = source.hf_config.get("model_type")
    if heads and (model_type != MODEL_TYPE or source.task != "embed"):
        raise BgeM3Error(
            f"{source.folder}: bge-m3's heads ({COLBERT_HEAD_FILE}, {SPARSE_HEAD_FILE}) are implemented on an"
            f" XLM-RoBERTa embedder only, this folder's task is {source.task} and its model_type {model_type!r}"
        )
    return heads


def _pooling(source: HeadFolder) -> tuple[str, bool]:
    """bge-m3's dense pooling: FlagEmbedding's, which the folder's sentence-transformers files must declare too."""
    declarations = source.declarations
    if (source.folder / "modules.json").is_file() and (declarations.pooling, declarations.normalize) != DENSE_POOLING:
        raise BgeM3Error(
            f"{declarations.pooling_file or source.folder / 'modules.json'}: declares {declarations.pooling} pooling"
            f"{'' if declarations.normalize else ' without Normalize'}, but FlagEmbedding's BGEM3FlagModel"
            " makes bge-m3's dense embedding from the first position, normalised"
        )
    return DENSE_POOLING


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[BgeM3Config, dict[str, Tensor]]:
    """bge-m3's ColBERT and sparse heads and the ids its term weights leave out, checked."""
    width, head_weights = read_heads(source.folder, weights.d_model)
    return BgeM3Config(width, unused_token_ids(source.folder)), head_weights


def _outputs(config: EncoderSettings, heads: BgeM3Config) -> tuple[GraphOutput, ...]:
    """The embedder's outputs, then every position's ColBERT vector and term weight."""
    return (
        *embedder_outputs(config),
        GraphOutput(TOKEN_VECTORS, (SEQUENCE, heads.colbert_width)),
        GraphOutput(TOKEN_WEIGHTS, (SEQUENCE, 1)),
    )


def _sentence_transformers_check(
    checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str], sentences: list[str]
) -> VariantCheck:
    """sentence-transformers' check where the folder has its files; FlagEmbedding alone checks one without them."""
    if not (checkpoint.folder / "modules.json").is_file():
        reason = "bge-m3 without sentence-transformers files: FlagEmbedding is its reference (flag_embedding)"
        return unchecked(reason, failed=False)
    return library.published_check(checkpoint, tokenizer, input_names, sentences)


def _flag_embedding_answers(run: ReferenceInputs) -> VariantCheck:
    """FlagEmbedding's BGEM3FlagModel on the folder, as each published variant's check."""
    return flag_embedding.published_check(run.checkpoint, run.tokenizer, run.input_names, run.sentences)


HEAD = Head(
    name="bge_m3",
    config_type=BgeM3Config,
    task="embed",
    claims=_claims,
    read=_read,
    wrap=BgeM3Encoder,
    outputs=_outputs,
    parameters=lambda heads: {P_MULTIVECTOR: MULTIVECTOR.to_json()},
    pooling=_pooling,
    ungated=Ungated(
        ("int8", "fp16"),
        "bge-m3: published in fp32 only (int8 and fp16 are not gated for token vectors and token weights)",
    ),
    library_check=_sentence_transformers_check,
    references=(
        Reference(
            stage="FlagEmbedding: BGEM3FlagModel on the source folder, for each published variant",
            library="FlagEmbedding",
            report_key="flag_embedding",
            needs_tokenizer=False,
            answers=_flag_embedding_answers,
        ),
    ),
)
"""bge-m3's ColBERT and sparse heads beside its dense embedding."""
