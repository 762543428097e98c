"""Tiny real tokenizers and text encoders for the built-in tiny random pipelines of every
medium (`families/*/tiny.py`): built here, offline, from config, seeded by the caller.

- `clip_tokenizer`: a CLIP BPE tokenizer over the 256 byte symbols (each with and without
  CLIP's end-of-word mark, no merges: one token per character);
- `t5_tokenizer`: a T5 unigram tokenizer over letters, digits and a little punctuation;
- `roberta_tokenizer`: a RoBERTa byte-level BPE tokenizer over the 256 byte symbols (no
  merges: one token per byte), CLAP's tokenizer;
- `clip_text_encoder`, `t5_text_encoder` (`umt5=True`: UMT5, Wan's text encoder): two layers,
  width 32; `clap_text_encoder`: CLAP's text tower with its projection (AudioLDM's), one
  layer.

Real tokenizers and encoders with tiny vocabularies and widths: the tests exercise the very
code paths a full-size pipeline takes.
"""

from __future__ import annotations

import string
from typing import Any

CLIP_VOCAB = 514  # 256 byte symbols, the same with "</w>", start and end of text
CLIP_WIDTH = 32
T5_WIDTH = 32
T5_MAX_LENGTH = 32


def clip_tokenizer() -> Any:
    """A real CLIP tokenizer with a tiny vocabulary: one token per character."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({f"{s}</w>": len(symbols) + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> Any:
    """A real T5 (unigram) tokenizer over letters, digits and some punctuation."""
    from transformers import T5Tokenizer

    symbols = string.ascii_letters + string.digits + ",.-'"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{c}", -2.5) for c in symbols] + [(c, -3.0) for c in symbols]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # RoBERTa's ids 0-3; <mask> is last
ROBERTA_MAX_LENGTH = 77  # AudioLDM's tokenizer pads every prompt to its model_max_length
CLAP_WIDTH = 32
CLAP_PROJECTION = 16


def roberta_tokenizer() -> Any:
    """A real RoBERTa tokenizer with a tiny vocabulary: one token per byte."""
    from tokenizers import pre_tokenizers
    from transformers import RobertaTokenizer

    vocab = {s: i for i, s in enumerate(ROBERTA_SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    vocab["<mask>"] = len(vocab)
    return RobertaTokenizer(vocab=vocab, merges=[], model_max_length=ROBERTA_MAX_LENGTH)


def clap_text_encoder() -> Any:
    """CLAP's text tower with its projection (`ClapTextModelWithProjection`, AudioLDM's text
    encoder): one layer of width 32 over `roberta_tokenizer`'s vocabulary, projected to 16."""
    from transformers import ClapTextConfig, ClapTextModelWithProjection

    config = ClapTextConfig(
        vocab_size=len(ROBERTA_SPECIALS) + 256 + 1, hidden_size=CLAP_WIDTH,
        intermediate_size=2 * CLAP_WIDTH, num_hidden_layers=1, num_attention_heads=2,
        # RoBERTa's positions start after the padding id (1): 2 + the longest prompt.
        max_position_embeddings=ROBERTA_MAX_LENGTH + 2, bos_token_id=0, pad_token_id=1,
        eos_token_id=2, projection_dim=CLAP_PROJECTION,
    )  # fmt: skip
    return ClapTextModelWithProjection(config)


def clip_text_encoder(*, projection: bool = False) -> Any:
    """A 2-layer CLIP text encoder of width 32 (with projection: pooled embeddings)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=CLIP_VOCAB, hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
        bos_token_id=CLIP_VOCAB - 2, eos_token_id=CLIP_VOCAB - 1, pad_token_id=CLIP_VOCAB - 1,
        projection_dim=CLIP_WIDTH,
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def t5_text_encoder(*, umt5: bool = False) -> Any:
    """A 2-layer T5 encoder of width 32 over `t5_tokenizer`'s vocabulary (UMT5 for Wan)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_cls(
        vocab_size=len(t5_tokenizer()), d_model=T5_WIDTH, d_kv=16, d_ff=2 * T5_WIDTH,
        num_layers=2, num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return model_cls(config)


def word_tokenizer_files(words: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a CLIP BPE tokenizer in which each of `words` is one token and any
    other lowercase word is spelt out in letters (never unknown): the two special tokens, every
    letter with and without CLIP's end-of-word mark `</w>`, and each word's suffixes. Each
    word's merges join its letters right to left ("e" + "d</w>" -> "ed</w>", then "r" +
    "ed</w>"), so every merge's right part ends in `</w>`: inside a word only the pair at its
    end can merge, and each listed word comes out whole whatever the order of the merges.
    Hand-written: no library builds a BPE from a word list without training one."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in letters + [f"{letter}</w>" for letter in letters]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:
        suffix = f"{word[-1]}</w>"
        for letter in reversed(word[:-1]):
            merge = (letter, suffix)
            suffix = letter + suffix
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(suffix, len(vocab))
    return vocab, merges
