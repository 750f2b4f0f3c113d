"""Tiny random CLIP and SigLIP folders as their libraries save them: model, tokenizer, preprocessor_config.json.

The models are transformers' CLIPModel and SiglipModel (random weights, seeded); the tokenizers are trained
on the gate sentences in each family's kind (CLIP: byte-level BPE ended by <|endoftext|>, which pads too;
SigLIP: Unigram pieces ended by </s>, padded with <pad>), saved as tokenizer.json, or (CLIP) as the vocab.json
and merges.txt transformers' CLIPTokenizer reads; the preprocessor configs are those of
openai/clip-vit-base-patch32 and google/siglip-base-patch16-224 at the tiny image size. The
sentence-transformers folders are saved in both its layouts: clip-ViT-B-32's (a CLIPModel module in
0_CLIPModel/, written here as it was) and sentence-transformers 6's (written by its own `save`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import transformers
from PIL import Image
from sentence_transformers import SentenceTransformer
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from export.__main__ import main as export_main
from service.pipeline.images import PREPROCESSOR_CONFIG
from tests import processor_configs
from tests.export import tiny_models
from tests.export.tiny_models import _byte_level_bpe, _randomise, _unigram
from tests.export_cache import cached_export
from tests.processor_configs import CLIP_CONFIG, SIGLIP_CONFIG

MAX_POSITIONS = 16
CLIP_WORDS = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
"""CLIP's pre-tokenisation pattern (transformers' CLIPTokenizer): the pieces a text is split into."""
CLIP_IMAGE_SIZE = 30
"""Not a multiple of the patch: the last pixels of each side are past the last whole patch."""
SIGLIP_IMAGE_SIZE = 32
PROJECTION = 24
LAYERS = {"intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4}
VISION = {"hidden_size": 48, "intermediate_size": 56, "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 8}


def _save_tokenizer(
    folder: Path, tokenizer: Tokenizer, template: str, **specials: str
) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer, each text put in template ($A: the text), wrapped by transformers and saved into folder."""
    named = {token for token in template.split() if token != "$A"}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(token, tokenizer.token_to_id(token)) for token in sorted(named)]
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=MAX_POSITIONS, **specials)
    fast.save_pretrained(str(folder))
    return fast


def _save_clip_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    """CLIP's kind: byte-level BPE, <|startoftext|> text <|endoftext|>, padded with <|endoftext|>."""
    start, end = "<|startoftext|>", "<|endoftext|>"
    tokenizer = _byte_level_bpe([start, end])
    return _save_tokenizer(
        folder, tokenizer, f"{start} $A {end}", bos_token=start, eos_token=end, pad_token=end, unk_token=end
    )


def _save_siglip_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    """SigLIP's kind: Unigram pieces, text </s>, padded with <pad>."""
    return _save_tokenizer(folder, _unigram(), "$A </s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def _text_config(tokenizer: transformers.PreTrainedTokenizerFast) -> dict[str, object]:
    """A tiny text tower sized to its tokenizer, ending and padding texts with the tokenizer's tokens."""
    return LAYERS | {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _save_model(model: torch.nn.Module, folder: Path, seed: int) -> None:
    _randomise(model.eval(), seed)
    model.save_pretrained(str(folder))


def _save_clip_vocabulary(folder: Path) -> transformers.PreTrainedTokenizerBase:
    """CLIP's tokenizer as openai/clip-vit-* ship it without tokenizer.json: vocab.json and merges.txt of a
    byte-level BPE whose word ends are marked </w>, read by transformers' CLIPTokenizer."""
    start, end = "<|startoftext|>", "<|endoftext|>"
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=end))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_WORDS), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=tiny_models.VOCAB_SIZE,
        special_tokens=[start, end],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
    )
    tokenizer.train_from_iterator(tiny_models.training_sentences(), trainer)
    tokenizer.model.save(str(folder))
    specials = {"bos_token": start, "eos_token": end, "pad_token": end, "unk_token": end}
    declared = {"tokenizer_class": "CLIPTokenizer", "model_max_length": MAX_POSITIONS} | specials
    (folder / "tokenizer_config.json").write_text(json.dumps(declared))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def save_clip_folder(folder: Path, seed: int = 48, *, vocabulary_files: bool = False) -> Path:
    """A tiny CLIPModel folder (30-pixel images in 8-pixel patches, both embeddings 24 wide).

    vocabulary_files: its tokenizer as vocab.json and merges.txt only (no tokenizer.json).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_clip_vocabulary(folder) if vocabulary_files else _save_clip_tokenizer(folder)
    text = _text_config(tokenizer) | {"bos_token_id": tokenizer.bos_token_id}
    config = transformers.CLIPConfig(
        text_config=text, vision_config=VISION | {"image_size": CLIP_IMAGE_SIZE}, projection_dim=PROJECTION
    )
    torch.manual_seed(seed)
    _save_model(transformers.CLIPModel(config), folder, seed)
    preprocessor = CLIP_CONFIG | {"crop_size": CLIP_IMAGE_SIZE, "size": CLIP_IMAGE_SIZE}
    (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor))
    return folder


def save_clip_vocabulary_folder(folder: Path, seed: int = 53) -> Path:
    """A tiny CLIPModel folder whose tokenizer is vocab.json and merges.txt only."""
    return save_clip_folder(folder, seed, vocabulary_files=True)


def save_siglip_folder(folder: Path, seed: int = 49) -> Path:
    """A tiny SiglipModel folder (32-pixel images in 8-pixel patches, both embeddings 48 wide)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_siglip_tokenizer(folder)
    text = _text_config(tokenizer) | {"projection_size": VISION["hidden_size"]}
    config = transformers.SiglipConfig(text_config=text, vision_config=VISION | {"image_size": SIGLIP_IMAGE_SIZE})
    torch.manual_seed(seed)
    _save_model(transformers.SiglipModel(config), folder, seed)
    preprocessor = SIGLIP_CONFIG | {"size": {"height": SIGLIP_IMAGE_SIZE, "width": SIGLIP_IMAGE_SIZE}}
    (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor))
    return folder


def save_sentence_transformers_clip(folder: Path, seed: int = 50) -> Path:
    """A sentence-transformers CLIP folder as clip-ViT-B-32 has it: modules.json naming one CLIPModel module in
    0_CLIPModel/, which holds the tiny CLIPModel folder (no Normalize: encode answers the raw projections)."""
    save_clip_folder(folder / "0_CLIPModel", seed)
    module = {"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}
    (folder / "modules.json").write_text(json.dumps([module]))
    return folder


def _saved_by_sentence_transformers(
    folder: Path, model_folder: Path, processing_kwargs: dict[str, object] | None = None
) -> Path:
    """model_folder loaded by sentence-transformers (with processing_kwargs) and saved into folder, as its
    `save` writes it: since 5.4 a Transformer module at the folder root, the processor's settings in
    processor_config.json."""
    model = SentenceTransformer(str(model_folder), device="cpu")
    if processing_kwargs is not None:
        model[0].processing_kwargs = processing_kwargs
    model.save(str(folder))
    return folder


def save_sentence_transformers6_clip(folder: Path, seed: int = 51) -> Path:
    """A tiny CLIPModel folder as sentence-transformers 6 saves it (texts padded to the batch's longest)."""
    return _saved_by_sentence_transformers(folder, save_clip_folder(folder.with_name(f"{folder.name}-model"), seed))


def save_sentence_transformers6_siglip(folder: Path, seed: int = 52) -> Path:
    """A tiny SiglipModel folder as sentence-transformers 6 saves it, its texts padded to max_length as SigLIP's."""
    model_folder = save_siglip_folder(folder.with_name(f"{folder.name}-model"), seed)
    return _saved_by_sentence_transformers(folder, model_folder, {"text": {"padding": "max_length"}})


SOURCES = {
    "clip": save_clip_folder,
    "siglip": save_siglip_folder,
    "clip-vocabulary": save_clip_vocabulary_folder,
    "st-clip": save_sentence_transformers_clip,
    "st6-clip": save_sentence_transformers6_clip,
    "st6-siglip": save_sentence_transformers6_siglip,
}
"""Each exported model's name and what makes its source folder."""


def _export_all(folder: Path) -> None:
    """Every tiny folder (folder/source/<name>), each exported by the command line into folder/repository with its
    default variants (fp32, int8, fp16), int8's speed bar off: at these sizes int8 is not faster, and the tests
    serve it."""
    for name, save in SOURCES.items():
        source = save(folder / "source" / name)
        command = ["--source", str(source), "--repository", str(folder / "repository"), "--name", name]
        status = export_main([*command, "--threads", "1", "--int8-min-speedup", "0"])
        assert status == 0, f"the export of {name} failed"


MADE_BY = (Path(__file__), Path(tiny_models.__file__), Path(processor_configs.__file__))
"""The files the folders are made by (tests.export_cache's made_by)."""


def exported_two_towers() -> Path:
    """The folder _export_all filled, shared across tests and pytest runs (tests.export_cache)."""
    return cached_export("two-towers", list(SOURCES), _export_all, made_by=MADE_BY)


def _features(output: object) -> torch.Tensor:
    """get_*_features' answer (a tensor, or an output holding it as pooler_output), normalised as served."""
    vectors = output if isinstance(output, torch.Tensor) else output.pooler_output
    return torch.nn.functional.normalize(vectors, dim=-1)


def library_embeddings(
    source: Path, images: list[bytes], texts: list[str], padding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the library that made the folder answers for the images and the texts, as the model is served.

    A sentence-transformers folder: its encode (raw: no Normalize module); else transformers with the folder's
    processor and tokenizer, normalised.
    """
    pictures = [Image.open(io.BytesIO(image)) for image in images]
    if (source / "modules.json").is_file():
        model = SentenceTransformer(str(source), device="cpu")
        encoded = [
            model.encode(items, convert_to_tensor=True) if items else torch.empty(0) for items in (pictures, texts)
        ]
        return encoded[0], encoded[1]
    reference = transformers.AutoModel.from_pretrained(str(source)).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(source))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    padded = "max_length" if padding == "max_length" else True
    with torch.inference_mode():
        image_features = torch.empty(0)
        if pictures:
            pixel_values = processor(images=pictures, return_tensors="pt")["pixel_values"]
            image_features = _features(reference.get_image_features(pixel_values=pixel_values))
        text_features = torch.empty(0)
        if texts:
            ids = tokenizer(texts, padding=padded, truncation=True, max_length=MAX_POSITIONS, return_tensors="pt")
            text_features = _features(reference.get_text_features(**ids))
    return image_features, text_features
