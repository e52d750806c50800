"""Any Hugging Face text encoder or decoder as the base of a classifier: loading (offline, a set
dtype, no LM head), the tokenizer fixed for batching (pad token), pooling (mean, cls, last
non-padding token, or `auto`), the layers to fine-tune, merge and quantize found from the model's
structure, and a content hash of the model's files.

    model, tokenizer = load_base(path, dtype="float32")     # AutoModel: no LM head
    pooling = resolve_pooling(path, model.config, "auto")   # sentence-transformers config, else mean/last
    feats = encode(model, input_ids, attention_mask, pooling)
    pattern = block_linear_pattern(model)                    # regex of every nn.Linear in the blocks

Structure, not names: the transformer blocks are the largest nn.ModuleList whose children are all
of one type (BERT `encoder.layer`, DistilBERT `transformer.layer`, ModernBERT `layers`, Llama
`layers`); every nn.Linear inside them is a layer to fine-tune and quantize. A model whose blocks
hold no nn.Linear (GPT-2's Conv1D) is refused with an error naming the module types it holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from torch import nn

# resolved at import: transformers' lazy attributes are not safe to resolve from several threads
from transformers import AutoModel, AutoTokenizer

POOLINGS = ("auto", "mean", "cls", "last")
DTYPES = ("float32", "bfloat16", "float16")
# model types that are causal LMs without a masked-LM head (when config.architectures says nothing)
DECODER_TYPES = {
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "gpt2",
    "gpt_neox",
    "gptj",
    "opt",
    "falcon",
    "olmo",
    "olmo2",
    "smollm3",
    "granite",
    "stablelm",
    "starcoder2",
    "cohere",
    "bloom",
}


def is_decoder(config) -> bool:
    """True for a causal LM (each token sees only the tokens before it): last-token pooling,
    position ids from the attention mask."""
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return True
    if (
        any(a.endswith(("ForMaskedLM", "Model")) for a in archs)
        and getattr(config, "model_type", "") not in DECODER_TYPES
    ):
        return False
    return getattr(config, "model_type", "") in DECODER_TYPES or bool(getattr(config, "is_decoder", False))


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype = {name!r}; expected one of {DTYPES}")
    return getattr(torch, name)


def prepare_tokenizer(tokenizer):
    """A tokenizer that can pad a batch: a missing pad token becomes the eos token (decoders ship
    none), and padding goes on the right, as crucible.train.collate pads (an encoder's absolute
    positions then start at 0 for every text). A decoder padded on either side gives the same
    features: pooling reads the mask and `encode` counts position ids from the first real token.
    Returns the tokenizer."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{type(tokenizer).__name__}: no pad token and no eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a local folder (or a cached hub id), never downloading: the base
    model without any head (AutoModel: a decoder's LM head is not loaded), in `dtype`, eval mode."""
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch_dtype(dtype))
    model.eval()
    return model, tokenizer


def build_from_config(config, dtype: str | torch.dtype = "float32"):
    """The base architecture of `config` with uninitialised-then-overwritten weights, in `dtype`."""
    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    return AutoModel.from_config(config, dtype=dt)


# ---------------------------------------------------------------------------------------------------
# pooling


def resolve_pooling(path: str | Path | None, config, pooling: str = "auto") -> str:
    """`pooling`, or for `auto`: the sentence-transformers pooling config the model ships
    (1_Pooling/config.json: mean, cls or lasttoken), else mean for an encoder and the last
    non-padding token for a decoder."""
    if pooling not in POOLINGS:
        raise ValueError(f"model.pooling = {pooling!r}; expected one of {POOLINGS}")
    if pooling != "auto":
        return pooling
    shipped = sentence_transformers_pooling(path) if path is not None else None
    if shipped is not None:
        return shipped
    return "last" if is_decoder(config) else "mean"


def sentence_transformers_pooling(path: str | Path) -> str | None:
    """mean / cls / last from a sentence-transformers folder's Pooling module config, or None."""
    folder = Path(path)
    candidates = []
    modules = folder / "modules.json"
    if modules.is_file():
        try:
            for m in json.loads(modules.read_text()):
                if str(m.get("type", "")).endswith("Pooling"):
                    candidates.append(folder / m.get("path", "") / "config.json")
        except (json.JSONDecodeError, AttributeError):
            pass
    candidates.append(folder / "1_Pooling" / "config.json")
    for c in candidates:
        if c.is_file():
            cfg = json.loads(c.read_text())
            if "pooling_mode" in cfg:  # newer sentence-transformers
                mode = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(cfg["pooling_mode"])
                if mode:
                    return mode
            for key, mode in (
                ("pooling_mode_mean_tokens", "mean"),
                ("pooling_mode_cls_token", "cls"),
                ("pooling_mode_lasttoken", "last"),
            ):
                if cfg.get(key):
                    return mode
            raise ValueError(f"{c}: pooling mode {cfg} is not supported by crucible (mean, cls, lasttoken)")
    return None


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states where attention_mask = 1. hidden (b, t, d), mask (b, t) -> (b, d)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def last_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b,) index of the last position with mask 1 (right or left padding alike)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.bool() * (positions + 1)).argmax(1)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """(b, d) features of (b, t, d) token states: mean over the mask, the first token, or the last
    non-padding token."""
    if pooling == "mean":
        return mean_pool(hidden, attention_mask)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index(attention_mask)]
    raise ValueError(f"pooling {pooling!r}; expected mean, cls or last (resolve `auto` with resolve_pooling)")


def forward_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """last_hidden_state of the base model. A decoder gets position ids counted from its first
    real token, so left and right padding give the same states for the real tokens. The inputs
    go to the model's device."""
    from crucible.device import model_device

    device = model_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if is_decoder(model.config):
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def encode(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str = "mean"
) -> torch.Tensor:
    """Pooled features (b, d) of the base model (in its dtype), on the model's device (the inputs
    go there first)."""
    from crucible.device import model_device

    device = model_device(model)
    attention_mask = attention_mask.to(device)
    return pool(forward_hidden(model, input_ids.to(device), attention_mask), attention_mask, pooling)


def max_length(tokenizer, config, cap: int | None) -> int | None:
    """The model's own limit (tokenizer.model_max_length, config.max_position_embeddings), capped by
    `cap`; None when neither is known and no cap is given."""
    limits = [
        v
        for v in (getattr(tokenizer, "model_max_length", None), getattr(config, "max_position_embeddings", None))
        if isinstance(v, int) and 0 < v < 10**7
    ]
    if cap is not None:
        limits.append(cap)
    return min(limits) if limits else None


# ---------------------------------------------------------------------------------------------------
# structure


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, list) of the model's repeated transformer blocks: the nn.ModuleList with the
    most children that are all of one type (the parameter count breaks ties)."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            key = (len(module), sum(p.numel() for p in module.parameters()))
            if best_key is None or key > best_key:
                best, best_key = (name, module), key
    if best is None:
        raise ValueError(
            f"{type(model).__name__}: no nn.ModuleList of identical blocks found; "
            f"give the layers as a regex (finetune.modules, quantize.modules)"
        )
    return best


def block_linear_pattern(model: nn.Module) -> str:
    """A regex (for re.search on qualified names) that selects every nn.Linear inside the model's
    transformer blocks. ValueError naming the module types when the blocks hold no nn.Linear."""
    name, blocks = transformer_blocks(model)
    if not any(isinstance(m, nn.Linear) for m in blocks.modules()):
        kinds = sorted({type(m).__name__ for m in blocks[0].modules() if not list(m.children())})
        raise ValueError(
            f"{type(model).__name__}: its transformer blocks ({name}) hold no nn.Linear (leaf modules: "
            f"{', '.join(kinds)}); crucible fine-tunes, merges and quantizes nn.Linear layers only "
            f"(GPT-2 style Conv1D is not supported)"
        )
    return "^" + re.escape(name) + r"\.\d+\." if name else r"^\d+\."


def resolve_modules(model: nn.Module, spec: str) -> str:
    """`auto` -> block_linear_pattern(model); a regex is returned as it is."""
    return block_linear_pattern(model) if spec == "auto" else spec


def input_embedding_pattern(model: nn.Module) -> str:
    """A regex that selects the module get_input_embeddings() returns, by its qualified name."""
    emb = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is emb:
            return "^" + re.escape(name) + "$"
    raise ValueError(f"{type(model).__name__}: get_input_embeddings() is not a submodule of the model")


def resolve_embeddings(model: nn.Module, spec: str | None) -> str | None:
    """`auto` -> input_embedding_pattern(model); a regex or None as it is."""
    return input_embedding_pattern(model) if spec == "auto" else spec


def count_linears(model: nn.Module, pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(1 for n, m in model.named_modules() if isinstance(m, nn.Linear) and rx.search(n))


# ---------------------------------------------------------------------------------------------------
# content


def file_md5(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def folder_manifest(folder: str | Path) -> dict:
    """{files: {relative path: md5}, hash: md5 of the sorted (path, md5) pairs} of every file in
    a model folder (hidden files and READMEs excluded: they change nothing the model computes)."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if (
            p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
            and p.name.lower() != "readme.md"
            and "__pycache__" not in rel
        ):
            files[rel] = file_md5(p)
    digest = hashlib.md5(json.dumps(sorted(files.items())).encode()).hexdigest()
    return {"files": files, "hash": digest}
