"""The MoE branch's stages (moe_build, moe_quantize) on a tiny random Llama saved as a local folder
(moe.model names a folder; the packaged SmolLM2 is for the benchmark): outputs, offline loading,
metrics, byte-identical reruns, refusals that write nothing, and the switched-off path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tasks.stages import execute

MOE = {
    "enabled": True,
    "n_experts": 4,
    "top_k": 2,
    "shared_share": 0.25,
    "recover_steps": 3,
    "seq_len": 16,
    "build_sequences": 6,
    "calib_sequences": 6,
    "eval_sequences": 6,
    "batch_size": 3,
    "qat_steps": 6,
    "rank_budget": 24,
}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    """A random LlamaForCausalLM (hidden 64, FFN 128, 2 layers) with the MiniLM WordPiece tokenizer
    (its [SEP] as end of text), saved as a Hugging Face folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tasks.data.models import resolve_model

    folder = tmp_path_factory.mktemp("tiny_lm")
    tok = AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, 0.15)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _workspace(tmp_path: Path, project_root: Path, tiny_lm: Path, **moe) -> Path:
    from tasks.runtime.workspace import make_workspace

    return make_workspace(
        project_root, tmp_path / "ws", "tiny", overrides={"moe": {**MOE, "model": str(tiny_lm), **moe}}
    )


def _md5s(root: Path, folder: str) -> dict[str, str]:
    from tasks.runtime.io import md5_file

    return {p.name: md5_file(p) for p in sorted((root / folder).iterdir()) if p.is_file()}


def test_build_writes_a_qwen2_moe_with_a_shared_expert_that_loads_offline(tmp_path, project_root, tiny_lm):
    from transformers import AutoModelForCausalLM

    root = _workspace(tmp_path, project_root, tiny_lm)
    result = execute("moe_build", None, root)
    build = json.loads((root / "models/moe/build/build.json").read_text())
    assert build["enabled"] and build["n_experts"] == 4 and build["layers"] == 2
    assert build["unit_weight_max_abs_diff"] < 1e-3
    ppl = build["perplexity"]
    assert 1 < ppl["dense"] < 2 * 30522 and 1 < ppl["moe_float"] < 2 * 30522
    assert build["active_share"] == 0.25 + 0.75 * 2 / 4 and len(build["recover"]["loss"]) == 3
    assert all(r["after"] <= r["before"] for r in build["refit_error"]) and len(build["shared_mass"]) == 2
    assert all(abs(sum(layer) - 1) < 1e-6 for layer in build["expert_load"])  # shares of the routed tokens
    moe = AutoModelForCausalLM.from_pretrained(root / "models/moe/build", local_files_only=True)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"
    assert tuple(moe.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 2 * 24, 64)
    assert tuple(moe.model.layers[0].mlp.shared_expert.down_proj.weight.shape) == (64, 32)
    assert set(result.outputs) == {f"models/moe/build/{n}" for n in _md5s(root, "models/moe/build")}
    first = _md5s(root, "models/moe/build")
    execute("moe_build", None, root)
    assert _md5s(root, "models/moe/build") == first  # same inputs, same bytes


def test_switched_off_writes_only_a_note(tmp_path, project_root, tiny_lm):
    root = _workspace(tmp_path, project_root, tiny_lm, enabled=False)
    execute("moe_build", None, root)
    assert sorted(p.name for p in (root / "models/moe/build").iterdir()) == ["build.json"]
    assert json.loads((root / "models/moe/build/build.json").read_text())["enabled"] is False


def test_a_bad_expert_count_is_refused_before_anything_is_written(tmp_path, project_root, tiny_lm):
    root = _workspace(tmp_path, project_root, tiny_lm, n_experts=5)  # 96 routed neurons do not split in 5
    with pytest.raises(ValueError, match="leaves 96 of intermediate_size=128 neurons for n_experts=5"):
        execute("moe_build", None, root)
    assert not (root / "models/moe/build").exists()


def test_top_k_must_be_sparse():
    from tasks.runtime.params import ParamsError, validate_params

    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    base["moe"] = {"n_experts": 4, "top_k": 4}
    with pytest.raises(ParamsError, match="moe.top_k = 4 must be below moe.n_experts = 4"):
        validate_params(base, "params.yaml")


def test_quantize_compares_the_variants_and_writes_a_loadable_model(tmp_path, project_root, tiny_lm):
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from crucible.moe.mx_storage import load_quantized_moe

    root = _workspace(tmp_path, project_root, tiny_lm)
    execute("moe_build", None, root)
    execute("moe_quantize", None, root)
    m = json.loads((root / "metrics/moe.json").read_text())
    assert m["enabled"] and m["rank_budget"] == 24
    assert set(m["perplexity"]) >= {"dense", "float", "mxfp4", "uniform", "load_aware", "qat"}
    assert m["ranks"]["total"]["uniform"] == m["ranks"]["total"]["load_aware"] == 24
    assert m["variants"]["float"]["consistency_mean"]["set"] == 1.0
    cons = pd.read_csv(root / "models/moe/quantize/consistency.csv")
    assert set(cons["variant"]) >= {"float", "mxfp4", "uniform", "load_aware", "qat"} and set(cons["layer"]) == {0, 1}
    ranks = pd.read_csv(root / "models/moe/quantize/ranks.csv")
    assert ranks["uniform"].sum() == ranks["load_aware"].sum() == 24
    skeleton = AutoModelForCausalLM.from_pretrained(root / "models/moe/build", local_files_only=True)
    qmodel = load_quantized_moe(root / "models/moe/quantize/model.safetensors", skeleton)
    if qmodel.config.tie_word_embeddings:  # the head is the embedding written once, not uninitialised memory
        assert qmodel.get_output_embeddings().weight is qmodel.get_input_embeddings().weight
        assert not qmodel.get_output_embeddings().weight.is_meta
    ids = torch.randint(0, 1000, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(qmodel(input_ids=ids).logits).all()
    # what a long-lived process met (the whole test suite in one process): from_pretrained left the
    # head apart from the embedding, on the meta device; the loader must tie it, not copy into it
    skeleton = AutoModelForCausalLM.from_pretrained(root / "models/moe/build", local_files_only=True)
    head = skeleton.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.empty(head.weight.shape, device="meta"))
    qmodel = load_quantized_moe(root / "models/moe/quantize/model.safetensors", skeleton)
    assert qmodel.get_output_embeddings().weight is qmodel.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.isfinite(qmodel(input_ids=ids).logits).all()
    first = _md5s(root, "models/moe/quantize")
    execute("moe_quantize", None, root)
    assert _md5s(root, "models/moe/quantize") == first  # byte-identical rerun
    assert not (root / ".crucible/checkpoints/moe_quantize").exists()  # QAT checkpoints removed on success


def test_quantize_switched_off_and_a_missing_build(tmp_path, project_root, tiny_lm):
    root = _workspace(tmp_path, project_root, tiny_lm, enabled=False)
    with pytest.raises(FileNotFoundError, match="run the moe_build stage first"):
        execute("moe_quantize", None, root)
    assert not (root / "metrics/moe.json").exists()
    execute("moe_build", None, root)
    execute("moe_quantize", None, root)
    assert json.loads((root / "metrics/moe.json").read_text()) == {
        "enabled": False,
        "note": "moe.enabled is false: the MoE branch did not run",
    }
    assert sorted(p.name for p in (root / "models/moe/quantize").iterdir()) == ["disabled.json"]


def test_sequences_draws_only_the_parts_asked_and_the_same_draw_each_time(tiny_lm):
    """A stage asks for the parts it uses (it declares only their counts); a part is the same tensor
    whether asked alone or with the others, and an unknown part is refused by name."""
    from transformers import AutoTokenizer

    from tasks.data.moe_text import sequences
    from tasks.runtime.params import load_params

    p = load_params(Path(__file__).resolve().parents[2] / "params.yaml").moe.model_copy(
        update={"seq_len": 16, "build_sequences": 3, "recover_sequences": 4, "calib_sequences": 5, "eval_sequences": 2}
    )
    tok = AutoTokenizer.from_pretrained(tiny_lm)
    every = sequences(tok, p, seed=7)
    assert {k: tuple(v.shape) for k, v in every.items()} == {
        "build": (3, 16),
        "recover": (4, 16),
        "calib": (5, 16),
        "eval": (2, 16),
    }
    some = sequences(tok, p, seed=7, parts=("calib", "eval"))
    assert sorted(some) == ["calib", "eval"]
    assert all(torch.equal(some[k], every[k]) for k in some)
    assert not torch.equal(every["build"][:3], every["calib"][:3])  # each part its own seed
    with pytest.raises(ValueError, match=r"parts \['train'\]"):
        sequences(tok, p, seed=7, parts=("build", "train"))
