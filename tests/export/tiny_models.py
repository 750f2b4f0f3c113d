"""Tiny randomly initialised Hugging Face models with real tokenizers of their family, saved as folders.

No model hub here: each test makes its model. Tokenizers are trained on the exporter's own
sentences: WordPiece for BERT, DistilBERT and MPNet, byte-level BPE in RoBERTa's form, Unigram
in XLM-R's form and in DeBERTa-v3's (transformers' DebertaV2Tokenizer around the trained pieces).
Folders are what `transformers.save_pretrained` writes, optionally wrapped as a sentence-transformers
model (Transformer + Pooling (+ Dense) (+ Normalize)), or as a SparseEncoder (MLMTransformer +
SpladePooling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from sentence_transformers import SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Dense
from sentence_transformers.sentence_transformer import modules as st_models
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from export.gate.cases import SENTENCES_FILE, read_sentences

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "modernbert", "deberta-v2")
VOCAB_SIZE = 400
HIDDEN = 32
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 80
MODERNBERT_WINDOW = 8
"""ModernBERT's local window here: sentences are longer, so local layers see only part of them."""
DEBERTA_BUCKETS = 16
"""DeBERTa's position buckets here: distances beyond 8 tokens fall in log-spaced buckets."""


def training_sentences() -> list[str]:
    """The shipped gate sentences, the tokenizers' training text."""
    return read_sentences(SENTENCES_FILE)


def _wordpiece(special: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(
        training_sentences(), trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=special)
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def _byte_level_bpe(special: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(training_sentences(), trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _unigram() -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.UnigramTrainer(vocab_size=VOCAB_SIZE, special_tokens=special, unk_token="<unk>")
    tokenizer.train_from_iterator(training_sentences(), trainer)
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def _deberta_v3(max_length: int) -> transformers.PreTrainedTokenizerFast:
    """DeBERTa-v3's tokenizer: Unigram pieces in transformers' DebertaV2Tokenizer ([CLS] a [SEP] b [SEP])."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    special = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]  # DeBERTa-v3's ids 0-3 ([MASK] is last there)
    trainer = trainers.UnigramTrainer(vocab_size=VOCAB_SIZE, special_tokens=special, unk_token="[UNK]")
    tokenizer.train_from_iterator(training_sentences(), trainer)
    unigram = json.loads(tokenizer.to_str())["model"]
    pieces = [(piece, score) for piece, score in unigram["vocab"]]
    return transformers.DebertaV2Tokenizer(vocab=pieces, unk_id=unigram["unk_id"], model_max_length=max_length)


def save_tokenizer(
    family: str, folder: Path, max_length: int = MAX_POSITIONS - 2
) -> transformers.PreTrainedTokenizerFast:
    """Train a tokenizer of the family's kind and save it (tokenizer.json and its config) into folder."""
    if family == "deberta-v2":
        fast = _deberta_v3(max_length)
        fast.save_pretrained(str(folder))
        return fast
    if family in ("bert", "distilbert", "mpnet"):
        # MPNet pads with id 1 (its positions count after it), as its real vocabulary does; BERT with 0.
        order = (
            ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
            if family == "mpnet"
            else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        )
        tokenizer = _wordpiece(order)
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        wrapper = {"bert": transformers.BertTokenizerFast, "distilbert": transformers.DistilBertTokenizerFast}.get(
            family, transformers.PreTrainedTokenizerFast
        )
        specials = {
            "unk_token": "[UNK]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        }
        if family == "mpnet":
            # MPNet's tokenizer pairs as RoBERTa does; its special tokens are named as BERT's here.
            tokenizer.post_processor = processors.RobertaProcessing(
                ("[SEP]", sep), ("[CLS]", cls), add_prefix_space=False
            )
    elif family == "modernbert":
        # ModernBERT's tokenizer: byte-level BPE with BERT's special tokens and pairing.
        tokenizer = _byte_level_bpe(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
        wrapper = transformers.PreTrainedTokenizerFast
        specials = {
            "unk_token": "[UNK]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "mask_token": "[MASK]",
        }
    else:
        roberta_specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tokenizer = _byte_level_bpe(roberta_specials) if family == "roberta" else _unigram()
        tokenizer.post_processor = processors.RobertaProcessing(
            ("</s>", tokenizer.token_to_id("</s>")), ("<s>", tokenizer.token_to_id("<s>")), add_prefix_space=False
        )
        wrapper = transformers.PreTrainedTokenizerFast
        specials = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "cls_token": "<s>",
            "sep_token": "</s>",
            "mask_token": "<mask>",
        }
    fast = wrapper(tokenizer_object=tokenizer, model_max_length=max_length, **specials)
    fast.save_pretrained(str(folder))
    return fast


def hf_config(
    family: str, tokenizer: transformers.PreTrainedTokenizerFast, **overrides: object
) -> transformers.PretrainedConfig:
    """A tiny config of the family, sized to the tokenizer."""
    common = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if family == "modernbert":
        config = transformers.ModernBertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=3,  # global, local, local: both kinds of attention
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=MAX_POSITIONS,
            local_attention=MODERNBERT_WINDOW,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
            **common,
        )
    elif family == "deberta-v2":
        config = transformers.DebertaV2Config(  # DeBERTa-v3's settings, tiny
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            max_position_embeddings=MAX_POSITIONS,
            type_vocab_size=0,
            relative_attention=True,
            position_buckets=DEBERTA_BUCKETS,
            max_relative_positions=-1,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            pos_att_type="p2c|c2p",
            position_biased_input=False,
            layer_norm_eps=1e-7,
            **common,
        )
    elif family == "distilbert":
        config = transformers.DistilBertConfig(
            dim=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=4 * HIDDEN,
            max_position_embeddings=MAX_POSITIONS,
            **common,
        )
    else:
        kind = {
            "bert": transformers.BertConfig,
            "roberta": transformers.RobertaConfig,
            "xlm-roberta": transformers.XLMRobertaConfig,
            "mpnet": transformers.MPNetConfig,
        }[family]
        extra = {"max_position_embeddings": MAX_POSITIONS + (tokenizer.pad_token_id + 1 if family != "bert" else 0)}
        if family in ("roberta", "xlm-roberta"):
            extra["type_vocab_size"] = 1
        config = kind(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            **extra,
            **common,
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights far from their initial values, so that a mistaken mapping shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or "norm" in name.lower():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def save_model(family: str, folder: Path, task: str = "embed", seed: int = 0, **config: object) -> Path:
    """A tiny random model of the family with its tokenizer in folder; task "embed" (base model) or
    "classify" (sequence classification; pass num_labels / id2label in config)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(family, folder)
    hf = hf_config(family, tokenizer, **config)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if task == "classify" else transformers.AutoModel
    model = auto.from_config(hf, attn_implementation="eager").eval()
    _randomise(model, seed)
    model.save_pretrained(str(folder))
    return folder


def save_sentence_transformer(
    family: str,
    folder: Path,
    *,
    pooling: str = "mean",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    seed: int = 0,
    dense_width: int = 0,
) -> Path:
    """A tiny sentence-transformers model (Transformer + Pooling (+ Dense to dense_width) (+ Normalize)) in folder."""
    base = save_model(family, folder / "base", seed=seed)
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_POSITIONS - 2)
    pool = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
    modules = [transformer, pool]
    if dense_width:
        modules.append(Dense(transformer.get_embedding_dimension(), dense_width))
    modules += [st_models.Normalize()] if normalize else []
    model = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name)
    target = folder / "model"
    model.save(str(target))
    return target


SPARSE_BIAS_SHIFT = -2.5
"""Added to the tiny masked-LM head's bias: most logits negative, so that most vocabulary weights are 0, as in a
trained SPLADE model (a padding position leaking into the maximum would then show as a new nonzero)."""


def save_sparse_encoder(
    folder: Path,
    seed: int = 0,
    *,
    family: str = "bert",
    pooling_strategy: str = "max",
    activation_function: str = "relu",
    **config: object,
) -> Path:
    """A tiny SPLADE model (a family's masked-LM, config overrides applied) as sentence-transformers' SparseEncoder
    saves it: MLMTransformer + SpladePooling."""
    base = folder / "base"
    base.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(family, base)
    torch.manual_seed(seed)
    masked_lm = transformers.AutoModelForMaskedLM.from_config(hf_config(family, tokenizer, **config)).eval()
    _randomise(masked_lm, seed)
    with torch.no_grad():
        masked_lm.get_output_embeddings().bias.add_(SPARSE_BIAS_SHIFT)
    masked_lm.save_pretrained(str(base))
    pooling = SpladePooling(pooling_strategy=pooling_strategy, activation_function=activation_function)
    modules = [MLMTransformer(str(base), max_seq_length=MAX_POSITIONS - 2), pooling]
    target = folder / "model"
    SparseEncoder(modules=modules).save(str(target))
    return target


def read_json(path: Path) -> dict:
    """A JSON file's content."""
    return json.loads(path.read_text())


PROMPTS = {"query": "query: ", "passage": "passage: "}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@dataclass(frozen=True)
class TaskSource:
    """One source of the shared task repository: what it is and what its folder declares."""

    family: str
    task: str = "embed"
    pooling: str = "mean"
    normalize: bool = True
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] = ()
    labels: int = 1
    id2label: dict[int, str] | None = None


TASK_SOURCES = {
    "bert-embed": TaskSource("bert"),
    "roberta-embed": TaskSource("roberta", pooling="cls"),
    "xlmr-embed": TaskSource("xlm-roberta", prompts=PROMPTS, matryoshka_dimensions=(16, 8)),
    "distilbert-embed": TaskSource("distilbert", pooling="max", normalize=False),
    "mpnet-embed": TaskSource("mpnet", pooling="cls"),
    "modernbert-embed": TaskSource("modernbert", prompts=PROMPTS, default_prompt_name="passage"),
    "bert-reranker": TaskSource("bert", task="classify"),
    "xlmr-reranker": TaskSource("xlm-roberta", task="classify"),
    "distilbert-classifier": TaskSource("distilbert", task="classify", labels=3, id2label=LABELS),
}
"""Every architecture as an embedder (each pooling mode, prompts, Matryoshka widths) and every head style."""


def save_task_source(name: str, folder: Path, seed: int) -> Path:
    """The folder of one TASK_SOURCES entry: a sentence-transformers embedder, or a sequence classifier."""
    source = TASK_SOURCES[name]
    if source.task == "embed":
        return save_sentence_transformer(
            source.family,
            folder,
            pooling=source.pooling,
            normalize=source.normalize,
            prompts=source.prompts,
            default_prompt_name=source.default_prompt_name,
            seed=seed,
        )
    config = {"num_labels": source.labels} | ({"id2label": source.id2label} if source.id2label else {})
    return save_model(source.family, folder, task="classify", seed=seed, **config)
