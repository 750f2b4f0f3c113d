"""Tiny tokenizers of the decoder-derived families' kinds, trained on the gate sentences, saved into a folder.

Qwen2's byte-level BPE in Qwen3-Embedding's form (<|endoftext|> appended, padding on the left) and in
Qwen3-Reranker's (nothing appended; "yes", "no" and the model card's prompt in its training text), Llama 3's
byte-level BPE in EuroBERT's form (<|begin_of_text|> ... <|end_of_text|>), and Gemma's BPE (spaces as ▁,
byte fallback, <bos> ... <eos>). Each `save_*` writes tokenizer.json and its config into the folder and
returns transformers' tokenizer; the vocabulary is tiny_models.VOCAB_SIZE (plus Gemma's byte pieces).
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.export import tiny_models

QWEN_EOS = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = [QWEN_EOS, "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenisation pattern (its tokenizer.json's Split), before the byte-level mapping."""
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct"
    ' provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
"""Qwen3-Reranker's model card: the text before format_instruction's, as it is written there."""
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""Qwen3-Reranker's model card: the text after format_instruction's, as it is written there."""
LLAMA3_BOS, LLAMA3_EOS, EUROBERT_MASK = "<|begin_of_text|>", "<|end_of_text|>", "<|mask|>"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenisation pattern (its tokenizer.json's Split), before the byte-level mapping."""
GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
"""Gemma's first ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3."""
GEMMA_BYTE_TOKENS = [f"<0x{value:02X}>" for value in range(256)]


def _byte_level_bpe(split: str, special_tokens: list[str], texts: list[str], *, nfc: bool) -> Tokenizer:
    """Byte-level BPE as Qwen2's and Llama 3's tokenizer.json build it: the family's Split, then bytes mapped."""
    tokenizer = Tokenizer(models.BPE())
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=tiny_models.VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _qwen2_bpe(texts: list[str]) -> Tokenizer:
    """Qwen2's byte-level BPE (NFC, its Split, its three special tokens) trained on texts."""
    return _byte_level_bpe(QWEN2_SPLIT, QWEN_SPECIAL_TOKENS, texts, nfc=True)


def _saved(
    tokenizer: Tokenizer, folder: Path, max_length: int, **settings: object
) -> transformers.PreTrainedTokenizerFast:
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, **settings)
    fast.save_pretrained(str(folder))
    return fast


def save_qwen_tokenizer(folder: Path, max_length: int) -> transformers.PreTrainedTokenizerFast:
    """Qwen3-Embedding's form: Qwen2's BPE with <|endoftext|> appended to every text, padding on the left."""
    tokenizer = _qwen2_bpe(tiny_models.training_sentences())
    eos = tokenizer.token_to_id(QWEN_EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {QWEN_EOS}", pair=f"$A {QWEN_EOS} $B:1 {QWEN_EOS}:1", special_tokens=[(QWEN_EOS, eos)]
    )
    return _saved(
        tokenizer,
        folder,
        max_length,
        eos_token=QWEN_EOS,
        pad_token=QWEN_EOS,
        padding_side="left",  # as Qwen3-Embedding's tokenizer_config.json: sentence-transformers pads on the left
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
    )


def save_qwen_reranker_tokenizer(folder: Path, max_length: int) -> transformers.PreTrainedTokenizerFast:
    """Qwen3-Reranker's form: Qwen2's BPE (no token appended), "yes" and "no" tokens of their own.

    Trained on the model card's prefix too, so that the template is short; <think> and </think> added.
    """
    tokenizer = _qwen2_bpe([*tiny_models.training_sentences(), *["yes", "no"] * 50, QWEN3_RERANKER_PREFIX])
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's: added, not special
    fast = _saved(
        tokenizer,
        folder,
        max_length,
        eos_token="<|im_end|>",
        pad_token=QWEN_EOS,
        padding_side="left",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
    )
    assert fast.convert_tokens_to_ids("yes") != fast.unk_token_id and len(fast.encode("yes no")) == 2
    return fast


def save_llama3_tokenizer(folder: Path, max_length: int) -> transformers.PreTrainedTokenizerFast:
    """EuroBERT's form: Llama 3's byte-level BPE, <|begin_of_text|> $A <|end_of_text|> (which pads), <|mask|>."""
    tokenizer = _byte_level_bpe(
        LLAMA3_SPLIT, [LLAMA3_BOS, LLAMA3_EOS, EUROBERT_MASK], tiny_models.training_sentences(), nfc=False
    )
    bos, eos = LLAMA3_BOS, LLAMA3_EOS
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {bos}:1 $B:1 {eos}:1",
        special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))],
    )
    return _saved(tokenizer, folder, max_length, bos_token=bos, eos_token=eos, pad_token=eos, mask_token=EUROBERT_MASK)


def save_gemma_tokenizer(folder: Path, max_length: int) -> transformers.PreTrainedTokenizerFast:
    """BPE as Gemma's tokenizer.json builds it: spaces as ▁, no pre-tokenizer, byte fallback, <bos> $A <eos>."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=tiny_models.VOCAB_SIZE, special_tokens=GEMMA_SPECIAL_TOKENS)
    tokenizer.train_from_iterator(tiny_models.training_sentences(), trainer)
    spec = json.loads(tokenizer.to_str())
    for token in GEMMA_BYTE_TOKENS:  # byte fallback needs the 256 byte pieces, as Gemma's vocabulary has them
        spec["model"]["vocab"].setdefault(token, len(spec["model"]["vocab"]))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos, eos = tokenizer.token_to_id("<bos>"), tokenizer.token_to_id("<eos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)]
    )
    return _saved(
        tokenizer, folder, max_length, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
