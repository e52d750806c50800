"""Any Hugging Face text encoder or decoder through every step of the classifier pipeline, on tiny
random models built offline inside the test (tests/support/tiny_models.py): BERT, RoBERTa,
DistilBERT, DeBERTa-v2, MPNet, ModernBERT, Llama and Qwen2. Per family: automatic layer detection,
pooling, deterministic fine-tuning with dropout (two runs, the same bytes), a two-task merge, MXFP4
quantization of the detected layers and the input embedding, evaluation, and the registered
pyfunc loaded in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from support.tiny_models import DECODERS, FAMILIES, save_tiny, texts
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def _finetune(folder: Path, pattern: str, pooling: str, ids, labels, seed: int):
    from crucible.gmixout import GMixout, GMixoutConfig
    from crucible.models import load_base
    from crucible.train import EncoderClassifier, Examples, TrainConfig, train

    encoder, tokenizer = load_base(str(folder))
    model = EncoderClassifier(encoder, 2, dropout=0.1, seed=seed, pooling=pooling)
    gm = GMixout.wrap(model.encoder, GMixoutConfig(p=0.3, period=1, modules=pattern, seed=seed))
    data = Examples(ids, labels, torch.ones(len(ids)))
    train(
        model,
        data,
        data,
        TrainConfig(max_steps=3, batch_size=8, eval_every=3, seed=seed, progress=False, pad_id=tokenizer.pad_token_id),
        mixout=gm,
    )
    gm.unwrap()
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_through_every_step(family, tmp_path):
    from crucible.merge import make_merger, task_vector
    from crucible.models import (
        block_linear_pattern,
        count_linears,
        input_embedding_pattern,
        is_decoder,
        load_base,
        resolve_pooling,
    )
    from crucible.quant import load_quantized_encoder, quantize_model, save_quantized
    from crucible.quant.linear import quantize_embeddings
    from crucible.serialize import safetensors_bytes
    from crucible.train import EncoderClassifier, Examples, evaluate, tokenize
    from tasks.registry.pyfunc import save_multitask_model

    folder = save_tiny(family, tmp_path / "base")
    base, tokenizer = load_base(str(folder))
    assert tokenizer.pad_token is not None  # a decoder's is set to its eos token
    assert is_decoder(base.config) == (family in DECODERS)
    pooling = resolve_pooling(folder, base.config, "auto")
    assert pooling == ("last" if family in DECODERS else "mean")
    pattern = block_linear_pattern(base)
    n_linear = count_linears(base, pattern)
    assert n_linear >= 8  # 2 blocks x (q, k, v, o / qkv, ffn ...)
    theta_0 = {k: v.detach().clone() for k, v in base.state_dict().items()}

    sample = texts(24)
    ids = tokenize(tokenizer, sample, 16)
    labels = torch.tensor([i % 2 for i in range(len(sample))])

    # fine-tune: dropout (hidden and attention) draws from the run's generator: same seed, same bytes
    a = _finetune(folder, pattern, pooling, ids, labels, seed=1)
    again = _finetune(folder, pattern, pooling, ids, labels, seed=1)
    b = _finetune(folder, pattern, pooling, ids, labels, seed=2)
    state_a = {k: v.contiguous() for k, v in a.encoder.state_dict().items()}
    assert safetensors_bytes(state_a) == safetensors_bytes(
        {k: v.contiguous() for k, v in again.encoder.state_dict().items()}
    )
    assert any(not torch.equal(state_a[k], theta_0[k]) for k in theta_0 if theta_0[k].is_floating_point())

    # merge two tasks
    merger = make_merger("task_arithmetic", lam=0.5)
    for model in (a, b):
        merger.add(task_vector({k: v.detach().clone() for k, v in model.encoder.state_dict().items()}, theta_0))
    merged = merger.merged(theta_0)
    encoder, _ = load_base(str(folder))
    encoder.load_state_dict(merged, strict=True)

    # quantize the detected layers and the input embedding; the file rebuilds the same model
    quantize_model(encoder, pattern)
    quantize_embeddings(encoder, input_embedding_pattern(encoder))
    qfile = tmp_path / "quantize" / "model.safetensors"
    qfile.parent.mkdir()
    save_quantized(encoder, qfile, metadata={"base_model": family})
    rebuilt, _ = load_quantized_encoder(qfile, folder)
    batch = tokenizer(sample[:4], padding=True, return_tensors="pt")
    from crucible.models import encode

    with torch.no_grad():
        assert torch.allclose(
            encode(encoder.eval(), batch["input_ids"], batch["attention_mask"], pooling),
            encode(rebuilt, batch["input_ids"], batch["attention_mask"], pooling),
            atol=1e-5,
        )

    # evaluate with each task's head on the quantized model
    for model in (a, b):
        clf = EncoderClassifier(rebuilt, 2, dropout=0.0, pooling=pooling)
        clf.head.load_state_dict(model.head.state_dict())
        assert (
            0.0
            <= evaluate(clf, Examples(ids, labels, torch.ones(len(ids))), 8, tokenizer.pad_token_id)["accuracy"]
            <= 1.0
        )

    # the registered pyfunc, loaded in a fresh process from its folder alone
    heads = {
        f"{t}.{k}": v.detach().contiguous() for t, m in (("t1", a), ("t2", b)) for k, v in m.head.state_dict().items()
    }
    classes = {"t1": ["no", "yes"], "t2": ["neg", "pos"]}
    (tmp_path / "quantize" / "heads.safetensors").write_bytes(
        safetensors_bytes(heads, {"classes": json.dumps(classes)})
    )
    (tmp_path / "quantize" / "config.json").write_text(
        json.dumps(
            {
                "base_model": family,
                "classes": classes,
                "order": ["t1", "t2"],
                "max_length": {"t1": 16, "t2": 16},
                "pooling": pooling,
            }
        )
    )
    example = pd.DataFrame({"text": sample[:2], "task": ["t1", "t2"]})
    dest = save_multitask_model(tmp_path / "pyfunc", tmp_path / "quantize", "quantized", str(folder), example)
    folder.rename(tmp_path / "gone")  # nothing may be read from the base model's folder any more
    code = textwrap.dedent(f"""
        import json, mlflow.pyfunc, pandas as pd
        m = mlflow.pyfunc.load_model({str(dest)!r})
        out = m.predict(pd.DataFrame({{"text": {sample[:4]!r}, "task": ["t1", "t2", "t1", "t2"]}}))
        print(json.dumps(out["label"].tolist()))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": ""},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        expected = []
        for i, t in enumerate(["t1", "t2", "t1", "t2"]):
            clf = EncoderClassifier(rebuilt, 2, dropout=0.0, pooling=pooling)
            clf.head.load_state_dict((a if t == "t1" else b).head.state_dict())
            clf.eval()
            logits = clf(
                *[
                    x
                    for x in __import__("crucible.train", fromlist=["collate"]).collate(
                        [tokenize(tokenizer, [sample[i]], 16)[0]], tokenizer.pad_token_id
                    )
                ]
            )
            expected.append(classes[t][int(logits.argmax())])
    assert served == expected


def test_blocks_without_linear_are_refused_naming_the_module_type():
    from transformers import GPT2Config, GPT2Model

    from crucible.models import block_linear_pattern

    model = GPT2Model(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    with pytest.raises(ValueError, match="Conv1D"):
        block_linear_pattern(model)


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_last_pooling_same_vector_on_left_and_right_padding(family, tmp_path):
    from crucible.models import encode, load_base

    folder = save_tiny(family, tmp_path / "m")
    model, tokenizer = load_base(str(folder))
    sample = ["the film was great and the plot good", "bad"]
    vectors = {}
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = tokenizer(sample, padding=True, return_tensors="pt")
        with torch.no_grad():
            vectors[side] = encode(model, batch["input_ids"], batch["attention_mask"], "last")
    alone = tokenizer(sample[1:], return_tensors="pt")
    with torch.no_grad():
        single = encode(model, alone["input_ids"], alone["attention_mask"], "last")
    assert torch.allclose(vectors["right"], vectors["left"], atol=1e-5)
    assert torch.allclose(vectors["right"][1], single[0], atol=1e-5)


def test_auto_pooling_reads_the_packaged_models_sentence_transformers_config():
    from transformers import AutoConfig

    from crucible.models import resolve_pooling, sentence_transformers_pooling
    from tasks.data.models import resolve_model

    path = resolve_model("all-MiniLM-L6-v2")
    assert sentence_transformers_pooling(path) == "mean"
    assert resolve_pooling(path, AutoConfig.from_pretrained(path), "auto") == "mean"


def test_auto_pooling_prefers_the_shipped_config_over_the_family_default(tmp_path):
    from transformers import AutoConfig

    from crucible.models import resolve_pooling

    folder = save_tiny("bert", tmp_path / "m")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    assert resolve_pooling(folder, AutoConfig.from_pretrained(folder), "auto") == "cls"
    assert resolve_pooling(folder, AutoConfig.from_pretrained(folder), "last") == "last"


def test_minilm_auto_detection_matches_the_old_regexes():
    """The default (auto) selects exactly what encoder\\.layer\\.\\d+\\. and word_embeddings did, in
    the same order: MiniLM's bytes do not change."""
    from crucible.models import block_linear_pattern, input_embedding_pattern, load_base
    from crucible.quant.linear import select_linears, select_modules
    from tasks.data.models import resolve_model

    model, _ = load_base(resolve_model("all-MiniLM-L6-v2"))
    assert list(select_linears(model, block_linear_pattern(model))) == list(
        select_linears(model, r"encoder\.layer\.\d+\.")
    )
    assert len(select_linears(model, block_linear_pattern(model))) == 36
    assert list(select_modules(model, input_embedding_pattern(model), nn.Embedding)) == list(
        select_modules(model, "word_embeddings", nn.Embedding)
    )
