"""The encoder against independent references: torch's attention, transformers, sentence-transformers."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import BertModel

from export.checkpoints.checkpoint import load_checkpoint
from export.families.bert import ConfigError, Encoder, EncoderConfig, MultiHeadAttention, sinusoidal_positions
from export.gate.cases import read_sentences
from service.pipeline.tokenizer import TextTokenizer
from tests.vectors import assert_same_vectors


@pytest.fixture(scope="module")
def checkpoint(default_folder):
    return load_checkpoint(default_folder, "all-MiniLM-L6-v2")


@pytest.mark.parametrize(("d_model", "heads"), [(384, 12), (64, 4), (48, 1)])
def test_attention_matches_torch_multihead_attention(d_model: int, heads: int) -> None:
    torch.manual_seed(d_model + heads)
    ours = MultiHeadAttention(d_model, heads).eval()
    reference = torch.nn.MultiheadAttention(d_model, heads, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([ours.query.weight, ours.key.weight, ours.value.weight]))
        reference.in_proj_bias.copy_(torch.cat([ours.query.bias, ours.key.bias, ours.value.bias]))
        reference.out_proj.weight.copy_(ours.output.weight)
        reference.out_proj.bias.copy_(ours.output.bias)
    hidden = torch.randn(3, 11, d_model)
    mask = torch.ones(3, 11)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    bias = (1.0 - mask[:, None, None, :]) * torch.finfo(torch.float32).min
    with torch.no_grad():
        got = ours(hidden, bias)
        expected, _ = reference(hidden, hidden, hidden, key_padding_mask=~mask.bool(), need_weights=False)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_last_hidden_state_matches_transformers(checkpoint, default_folder) -> None:
    model = checkpoint.build_model()
    reference = BertModel.from_pretrained(str(default_folder), add_pooling_layer=False).eval()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 30522, (4, 37), generator=generator)
    mask = torch.ones(4, 37, dtype=torch.int64)
    mask[1, 20:] = 0
    mask[3, 5:] = 0
    types = torch.zeros_like(ids)
    types[:, 10:] = 1
    with torch.no_grad():
        ours, _ = model(ids, mask, types)
        theirs = reference(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    difference = (ours - theirs).abs()[mask.bool()].max().item()
    assert difference <= 1e-5, difference


def test_embeddings_match_sentence_transformers(checkpoint, default_folder) -> None:
    sentences = read_sentences()
    model = checkpoint.build_model()
    tokenizer = TextTokenizer(default_folder / "tokenizer.json", checkpoint.max_seq_length, 0)
    tokens = tokenizer.encode(sentences)
    with torch.no_grad():
        _, ours = model(
            torch.from_numpy(tokens.input_ids),
            torch.from_numpy(tokens.attention_mask),
            torch.from_numpy(tokens.token_type_ids),
        )
    theirs = SentenceTransformer(str(default_folder), device="cpu").encode(sentences, convert_to_numpy=True)
    # The true cosine (over both norms), and the values: a vector of the right direction but another length fails.
    assert_same_vectors(ours.numpy(), theirs, min_cosine=0.99999)
    assert tokens.input_ids.shape[1] == 256  # the long passages reach the model's limit


def test_tokenizer_uses_model_settings_not_file_defaults(default_folder) -> None:
    tokenizer = TextTokenizer(default_folder / "tokenizer.json", 256, 0)
    long_text = "word " * 400
    batch = tokenizer.encode(["short", long_text])
    assert batch.input_ids.shape == (2, 256)  # truncated at 256, not the file's 128
    assert tokenizer.encode(["short"]).input_ids.shape == (1, 3)  # padded to the longest, not to 128


def test_variants_of_the_architecture_run_and_pool() -> None:
    config = EncoderConfig(
        vocab_size=50,
        d_model=10,
        num_heads=2,
        num_layers=3,
        ffn_dim=16,
        max_positions=20,
        type_vocab_size=0,
        activation="relu",
        position_embedding="sinusoidal",
        pooling="cls",
        normalize=False,
    )
    model = Encoder(config).eval()
    ids = torch.randint(1, 50, (2, 6))
    with torch.no_grad():
        hidden, pooled = model(ids, torch.ones(2, 6, dtype=torch.int64))
    assert hidden.shape == (2, 6, 10)
    torch.testing.assert_close(pooled, hidden[:, 0])
    assert model.embeddings.segment is None
    table = sinusoidal_positions(20, 10)
    torch.testing.assert_close(model.embeddings.position.weight, table)
    assert table[0, 1] == 1.0 and table[0, 0] == 0.0


def test_mean_pooling_ignores_padding_and_normalises() -> None:
    config = EncoderConfig(vocab_size=50, d_model=8, num_heads=2, num_layers=1, ffn_dim=16, max_positions=16)
    model = Encoder(config).eval()
    ids = torch.randint(1, 50, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        _, alone = model(ids, torch.ones(1, 5, dtype=torch.int64))
        _, with_padding = model(padded, torch.tensor([[1] * 5 + [0] * 3]))
    torch.testing.assert_close(alone, with_padding, atol=1e-6, rtol=1e-5)
    assert abs(alone.norm().item() - 1.0) < 1e-6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 30, "num_heads": 4}, "d_model 30 is not divisible by num_heads 4"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"activation": "swish"}, "unsupported activation"),
        ({"pooling": "weightedmean"}, "unsupported pooling"),
    ],
)
def test_config_rejects_impossible_shapes(changes: dict, message: str) -> None:
    base = {"vocab_size": 10, "d_model": 8, "num_heads": 2, "num_layers": 1, "ffn_dim": 8}
    with pytest.raises(ConfigError, match=message):
        EncoderConfig(**{**base, **changes})
