"""The checkpoint formats the exporter reads: each architecture's config.json and weight names, mapped onto ours.

BERT, RoBERTa, XLM-RoBERTa, DistilBERT and MPNet are one encoder (export.families.bert) with different
settings; each is described here by how its config.json translates into an EncoderConfig and how
its parameter names map onto the encoder's. ModernBERT (export.families.modernbert), DeBERTa-v2/v3
(export.families.deberta), GTE, NomicBERT and jina-embeddings-v3 (export.families.rotary_bert, read by
export.families.rotary_bert_formats; Jina's task adapters by export.layers.task_adapters), Qwen3
(export.families.qwen3, a decoder read at its last token), Gemma3's bidirectional text model
(export.families.gemma, EmbeddingGemma) and EuroBERT (export.families.eurobert) are their own encoders.
Weights of task heads (poolers, classifiers, language model heads) are returned apart, for
export.heads.classifier.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from export.checkpoints.architecture_error import ArchitectureError
from export.families import deberta, eurobert, gemma, modernbert, qwen3, rotary_bert_formats
from export.families.config_facts import ConfigError, EncoderConfig
from export.families.rotary_bert import RotaryBertConfig

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
HEAD_PREFIXES = ("pooler.", "classifier.", "pre_classifier.", "lm_head.", "vocab_", "cls.")
"""Weights of task heads, kept apart from the encoder's."""
MPNET_PADDING_ID = 1
"""MPNet's embeddings take id 1 as padding whatever the config says (its vocabulary pads with 1)."""


@dataclass(frozen=True)
class WeightNames:
    """How a BERT-family checkpoint names its weights, and the encoder's names for them."""

    prefixes: tuple[str, ...]
    """Prefixes that wrap the base model inside task models and sentence-transformers modules."""
    layer_key: re.Pattern[str]
    """Matches a layer weight: groups are the layer index, the module and weight/bias."""
    layer_renames: dict[str, str]
    other_renames: dict[str, str]
    """Modules outside the layers (embeddings, relative attention bias) -> the encoder's."""

    def rename(self, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The encoder's weights under its names, and the task-head weights (prefix stripped) apart."""
        encoder: dict[str, torch.Tensor] = {}
        heads: dict[str, torch.Tensor] = {}
        for original, tensor in weights.items():
            key = original
            for prefix in self.prefixes:
                if key.startswith(prefix):
                    key = key[len(prefix) :]
                    break
            key = key.replace(".gamma", ".weight").replace(".beta", ".bias")
            if key.endswith("position_ids"):
                continue
            if key.startswith(HEAD_PREFIXES):
                heads[key] = tensor
                continue
            layer = self.layer_key.match(key)
            if layer:
                index, module, kind = layer.groups()
                if module not in self.layer_renames:
                    raise ArchitectureError(f"unexpected weight {original!r}")
                encoder[f"layers.{index}.{self.layer_renames[module]}.{kind}"] = tensor
                continue
            module, _, kind = key.rpartition(".")
            if module not in self.other_renames:
                raise ArchitectureError(f"unexpected weight {original!r}")
            encoder[f"{self.other_renames[module]}.{kind}"] = tensor
        return encoder, heads


Renamer = Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face model_type maps onto an encoder here."""

    model_type: str
    config: Callable[
        [dict, str, bool],
        EncoderConfig
        | modernbert.ModernBertConfig
        | deberta.DebertaConfig
        | RotaryBertConfig
        | qwen3.Qwen3Config
        | gemma.GemmaConfig
        | eurobert.EuroBertConfig,
    ]
    """config.json (with pooling and normalisation) -> the encoder's configuration."""
    rename: Renamer
    """The checkpoint's weights -> (the encoder's, under its names; the task heads', apart)."""


def _activation(hf_config: dict, key: str) -> str:
    activation = hf_config.get(key, "gelu")
    if activation not in ACTIVATIONS:
        raise ArchitectureError(f"unsupported {key} {activation!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[activation]


def _build(**fields: object) -> EncoderConfig:
    try:
        return EncoderConfig(**fields)
    except ConfigError as error:
        raise ArchitectureError(f"config.json: {error}") from error


def _require(hf_config: dict, *keys: str) -> None:
    for key in keys:
        if key not in hf_config:
            raise ArchitectureError(f"config.json lacks {key!r}")


def _bert_config(hf_config: dict, pooling: str, normalize: bool) -> EncoderConfig:
    _require(hf_config, "vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
    if "lora_adaptations" in hf_config:
        raise ArchitectureError(f"unsupported {JINA_REMOTE_CODE}")
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ArchitectureError(f"unsupported position_embedding_type {hf_config['position_embedding_type']!r}")
    if hf_config.get("is_decoder") and hf_config.get("model_type") != "mpnet":  # MPNet's attention ignores it
        raise ArchitectureError("unsupported is_decoder true (causal attention): only bidirectional encoders")
    roberta_style = hf_config.get("model_type") in ("roberta", "xlm-roberta", "mpnet")
    if hf_config.get("model_type") == "mpnet" and hf_config.get("pad_token_id", MPNET_PADDING_ID) != MPNET_PADDING_ID:
        raise ArchitectureError(f"MPNet counts positions after id {MPNET_PADDING_ID}: pad_token_id must be it")
    return _build(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["hidden_size"],
        num_heads=hf_config["num_attention_heads"],
        num_layers=hf_config["num_hidden_layers"],
        ffn_dim=hf_config["intermediate_size"],
        max_positions=hf_config.get("max_position_embeddings", 512),
        type_vocab_size=hf_config.get("type_vocab_size", 0 if hf_config.get("model_type") == "mpnet" else 2),
        activation=_activation(hf_config, "hidden_act"),
        layer_norm_eps=hf_config.get("layer_norm_eps", 1e-12),
        position_ids="after_padding" if roberta_style else "sequential",
        relative_attention_buckets=hf_config.get("relative_attention_num_buckets", 0),
        pooling=pooling,
        normalize=normalize,
        pad_token_id=hf_config.get("pad_token_id") or 0,
    )


def _distilbert_config(hf_config: dict, pooling: str, normalize: bool) -> EncoderConfig:
    _require(hf_config, "vocab_size", "dim", "n_heads", "n_layers", "hidden_dim")
    return _build(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["dim"],
        num_heads=hf_config["n_heads"],
        num_layers=hf_config["n_layers"],
        ffn_dim=hf_config["hidden_dim"],
        max_positions=hf_config.get("max_position_embeddings", 512),
        type_vocab_size=0,
        activation=_activation(hf_config, "activation"),
        layer_norm_eps=1e-12,
        pooling=pooling,
        normalize=normalize,
        pad_token_id=hf_config.get("pad_token_id") or 0,
    )


_BERT_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_BERT_LAYER_RENAMES = {
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
_WRAPPERS = ("0.auto_model.", "model.")


def _bert_like(model_type: str, prefix: str) -> Architecture:
    names = WeightNames((prefix, *_WRAPPERS), _BERT_LAYER, _BERT_LAYER_RENAMES, _EMBEDDING_RENAMES)
    return Architecture(model_type, _bert_config, names.rename)


_DISTILBERT_NAMES = WeightNames(
    ("distilbert.", *_WRAPPERS),
    re.compile(r"^transformer\.layer\.(\d+)\.(.+)\.(weight|bias)$"),
    {
        "attention.q_lin": "attention.query",
        "attention.k_lin": "attention.key",
        "attention.v_lin": "attention.value",
        "attention.out_lin": "attention.output",
        "sa_layer_norm": "attention_norm",
        "ffn.lin1": "feed_forward.inner",
        "ffn.lin2": "feed_forward.outer",
        "output_layer_norm": "output_norm",
    },
    _EMBEDDING_RENAMES,
)
_MPNET_NAMES = WeightNames(
    ("mpnet.", *_WRAPPERS),
    _BERT_LAYER,
    {
        "attention.attn.q": "attention.query",
        "attention.attn.k": "attention.key",
        "attention.attn.v": "attention.value",
        "attention.attn.o": "attention.output",
        "attention.LayerNorm": "attention_norm",
        "intermediate.dense": "feed_forward.inner",
        "output.dense": "feed_forward.outer",
        "output.LayerNorm": "output_norm",
    },
    {**_EMBEDDING_RENAMES, "encoder.relative_attention_bias": "relative_attention_bias"},
)
ARCHITECTURES: dict[str, Architecture] = {
    "bert": _bert_like("bert", "bert."),
    "roberta": _bert_like("roberta", "roberta."),
    "xlm-roberta": _bert_like("xlm-roberta", "roberta."),
    "distilbert": Architecture("distilbert", _distilbert_config, _DISTILBERT_NAMES.rename),
    "mpnet": Architecture("mpnet", _bert_config, _MPNET_NAMES.rename),
    "modernbert": Architecture("modernbert", modernbert.config_from_hf, modernbert.rename_weights),
    "deberta-v2": Architecture("deberta-v2", deberta.config_from_hf, deberta.rename_weights),
    "gte": Architecture("gte", rotary_bert_formats.gte_config, rotary_bert_formats.rename_gte_weights),
    "nomic_bert": Architecture(
        "nomic_bert", rotary_bert_formats.nomic_bert_config, rotary_bert_formats.rename_nomic_bert_weights
    ),
    "qwen3": Architecture("qwen3", qwen3.config_from_hf, qwen3.rename_weights),
    # Gemma3's text model names its weights as Qwen3's decoder does (embed_tokens, layers, norm).
    "gemma3_text": Architecture("gemma3_text", gemma.config_from_hf, qwen3.rename_weights),
    "eurobert": Architecture("eurobert", eurobert.config_from_hf, eurobert.rename_weights),
    "jina_embeddings_v3": Architecture(
        "jina_embeddings_v3", rotary_bert_formats.jina_config, rotary_bert_formats.rename_jina_weights
    ),
}
"""Supported model_type -> how to read it."""
JINA_REMOTE_CODE = (
    "jina-embeddings-v3 remote-code form (xlm-roberta with lora_adaptations, XLMRobertaLoRA), which transformers"
    " runs only with trust_remote_code: its transformers-native form (model_type 'jina_embeddings_v3' with one"
    " PEFT adapter folder per task, as jinaai/jina-embeddings-v3-hf) is supported"
)
REFUSAL_REASONS = {
    "new": "GTE's remote-code form, which transformers runs only with trust_remote_code;"
    " its transformers-native form (model_type 'gte', as alibaba-nlp-community/gte-base-en-v1.5) is supported",
    "gemma3": "Gemma3's image-and-text model; its text model (model_type 'gemma3_text', as EmbeddingGemma)"
    " is supported",
    "embedding_gemma2": "EmbeddingGemma 2, a Gemma4-based model (per-layer embeddings, images and audio), is not"
    " implemented; EmbeddingGemma (model_type 'gemma3_text') is",
    "embedding_gemma2_text": "EmbeddingGemma 2's text model (Gemma4's per-layer embeddings) is not implemented;"
    " EmbeddingGemma (model_type 'gemma3_text') is",
}
"""Unsupported model_types worth a reason beyond the list of supported ones."""


def architecture(model_type: object) -> Architecture:
    """The architecture of a config.json's model_type, or one line naming every supported one."""
    if model_type not in ARCHITECTURES:
        reason = f": {REFUSAL_REASONS[model_type]}" if model_type in REFUSAL_REASONS else ""
        supported = ", ".join(ARCHITECTURES)
        raise ArchitectureError(f"unsupported architecture {model_type!r}{reason} (supported: {supported})")
    return ARCHITECTURES[model_type]
