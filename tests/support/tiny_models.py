"""Tiny randomly initialised Hugging Face models of several families, saved as local folders with
a word-level tokenizer, built offline inside the tests (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [
    "market",
    "goal",
    "chip",
    "vote",
    "film",
    "great",
    "awful",
    "team",
    "price",
    "phone",
    "plot",
    "actor",
    "the",
    "a",
    "is",
    "was",
    "good",
    "bad",
    "win",
    "loss",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "</s>"]
COMMON = dict(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
DROPOUT = 0.1
FAMILIES = {
    "bert": dict(model_type="bert", hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT),
    "roberta": dict(
        model_type="roberta", pad_token_id=0, hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT
    ),
    "distilbert": dict(
        model_type="distilbert",
        vocab_size=32,
        dim=32,
        hidden_dim=64,
        n_layers=2,
        n_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        dropout=DROPOUT,
        attention_dropout=DROPOUT,
    ),
    "deberta-v2": dict(
        model_type="deberta-v2",
        pad_token_id=0,
        hidden_dropout_prob=DROPOUT,
        attention_probs_dropout_prob=DROPOUT,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
    ),
    "mpnet": dict(
        model_type="mpnet", pad_token_id=0, hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT
    ),
    "modernbert": dict(
        model_type="modernbert",
        pad_token_id=0,
        eos_token_id=5,
        bos_token_id=2,
        cls_token_id=2,
        sep_token_id=3,
        global_attn_every_n_layers=1,
        local_attention=8,
        attention_dropout=DROPOUT,
        mlp_dropout=DROPOUT,
        embedding_dropout=DROPOUT,
    ),
    "llama": dict(
        model_type="llama",
        num_key_value_heads=2,
        eos_token_id=5,
        bos_token_id=2,
        pad_token_id=None,
        attention_dropout=DROPOUT,
    ),
    "qwen2": dict(
        model_type="qwen2",
        num_key_value_heads=2,
        eos_token_id=5,
        bos_token_id=2,
        pad_token_id=None,
        attention_dropout=DROPOUT,
    ),
}
DECODERS = {"llama", "qwen2"}


def tokenizer(decoder: bool):
    """A word-level fast tokenizer over WORDS; an encoder's wraps texts in [CLS] ... [SEP] and pads
    with [PAD]; a decoder's has no pad token (crucible sets it to the eos token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", bos_token="[CLS]", model_max_length=64
        )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="</s>",
        model_max_length=64,
    )


def save_tiny(family: str, dest: Path, seed: int = 0) -> Path:
    """A tiny random model of `family` with its tokenizer, saved to the folder `dest`."""
    from transformers import AutoConfig, AutoModel

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    kwargs = {**({} if model_type == "distilbert" else COMMON), **spec}
    config = AutoConfig.for_model(model_type, **kwargs)
    if family in DECODERS:
        config.architectures = [f"{type(config).__name__.replace('Config', '')}ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    dest = Path(dest)
    model.save_pretrained(str(dest))
    tokenizer(family in DECODERS).save_pretrained(str(dest))
    return dest


def texts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]
