"""The quantize stage on a synthetic merged model (the base encoder plus a seeded perturbation, random
heads; the merge stage is tested elsewhere): outputs and metrics, the written model reloads to the
scored accuracy, bad input writes nothing."""

import json
import shutil

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from support.workspaces import TASKS, fake_merge

from tasks.runtime.io import md5_file
from tasks.stages import execute

torch.set_num_threads(1)
# the stage's outputs: the model and its figure under models/quantize/, the metrics and the plot data
# under metrics/ (where git commits them)
MODEL_FILES = ("model.safetensors", "heads.safetensors", "config.json", "features.safetensors", "quantize.png")
METRIC_FILES = ("quantize.json", "quantize_ranks.csv", "quantize_accuracy.csv")


def output_hashes(root) -> dict:
    """md5 of every file the stage writes (models/quantize/ and its files under metrics/)."""
    files = [*(root / "models" / "quantize").iterdir(), *(root / "metrics" / n for n in METRIC_FILES)]
    return {str(p.relative_to(root)): md5_file(p) for p in files if p.is_file()}


def make_project(tmp_path_factory, project_root, base_state, quantize=None):
    from tasks.runtime.workspace import make_workspace

    over = {"quantize": {"calibration_per_task": 8, "rank_per_matrix": 2, **(quantize or {})}}  # 36 x 2 = 72
    root = make_workspace(project_root, tmp_path_factory.mktemp("quant"), "tiny", overrides=over)
    # a profile's task mapping merges into the defaults: replace it with the two tasks here
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pipeline"]["tasks"] = {"rotten": {"corpus": "rotten_tomatoes"}, "bbc": {"corpus": "bbc_news"}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    fake_merge(root, base_state)
    return root


@pytest.fixture(scope="module")
def quantized_project(tmp_path_factory, project_root, base_state):
    root = make_project(tmp_path_factory, project_root, base_state)
    return root, execute("quantize", None, root)


def test_outputs_and_metrics(quantized_project):
    root, result = quantized_project
    out = root / "models" / "quantize"
    for name in MODEL_FILES:
        assert (out / name).is_file(), name
    for name in METRIC_FILES:
        assert (root / "metrics" / name).is_file(), name
    assert not {"quantize.json", "ranks.csv", "accuracy.csv"} & {p.name for p in out.iterdir()}
    m = json.loads((root / "metrics" / "quantize.json").read_text())
    assert m["matrices"] == 36 and m["bits_per_weight"] == pytest.approx(4.25)
    assert 4.25 < m["bits_per_weight_all_in"] < 5.0
    assert sum(m["ranks"].values()) == 72
    # the word embeddings are in MXFP4 too (quantize.embeddings): the file is under a fifth of the float one
    assert m["model_mb"]["quantized"] < 0.2 * m["model_mb"]["float"] and m["embeddings_mxfp4_mb"] > 5
    assert set(m["accuracy"]) == {"float", "mxfp4", "mxfp4_uniform", "mxfp4_load_aware"}
    assert set(m["accuracy"]["float"]) == set(TASKS)
    we = m["weighted_error"]
    assert we["load_aware"] <= we["uniform"] < we["mxfp4"]
    ranks = pd.read_csv(root / "metrics" / "quantize_ranks.csv")
    assert len(ranks) == 36 and ranks["rank_uniform"].sum() == ranks["rank_load_aware"].sum() == 72
    assert ranks["rank_uniform"].max() - ranks["rank_uniform"].min() <= 1
    assert (ranks["energy_kept_load_aware"] <= 1.0).all()
    assert (
        load_file(str(out / "heads.safetensors")).keys()
        == load_file(str(root / "models" / "merge" / "heads.safetensors")).keys()
    )
    assert result.metrics["bits_per_weight"] == pytest.approx(4.25)


def test_written_model_reloads_to_the_scored_accuracy(quantized_project):
    """The packed model on disk, rebuilt without the float weights, scores exactly what the stage
    reported for its allocation through the merge stage's heads, and its deployed accuracy through
    the written heads (refitted where better on the dev rows); the float figure equals scoring the
    merged weights directly."""
    from tasks.data.heldout_scoring import Scorer
    from tasks.data.models import resolve_model
    from tasks.stages.quantize import load_quantized_encoder

    root, _ = quantized_project
    m = json.loads((root / "metrics" / "quantize.json").read_text())
    tests = {t: pd.read_parquet(root / "data" / t / "test.parquet") for t in TASKS}
    scorers = {}
    for which, folder in (("merged", "merge"), ("deployed", "quantize")):
        heads = load_file(str(root / "models" / folder / "heads.safetensors"))
        specs = [
            {
                "task": t,
                "head": {"weight": heads[f"{t}.weight"], "bias": heads[f"{t}.bias"]},
                "classes": c,
                "max_length": 32,
            }
            for t, c in TASKS.items()
        ]
        scorers[which] = Scorer(resolve_model("all-MiniLM-L6-v2"), specs, tests, 64)
    scorer = scorers["merged"]
    scorer.load(load_file(str(root / "models" / "merge" / "model.safetensors")))
    for t in TASKS:
        assert scorer.accuracy(t) == pytest.approx(m["accuracy"]["float"][t], abs=1e-6)  # metrics keep 6 digits
    encoder, _ = load_quantized_encoder(root / "models" / "quantize")
    for which, key in (("merged", None), ("deployed", "deployed_accuracy")):
        scorers[which].use_encoder(encoder)
        for t in TASKS:
            expected = m["accuracy"]["mxfp4_load_aware"][t] if key is None else m[key][t]
            assert scorers[which].accuracy(t) == pytest.approx(expected, abs=1e-6)
    assert set(m["refit"]) == set(TASKS) and all(r["n_dev"] > 0 for r in m["refit"].values())


def test_same_inputs_give_the_same_model(quantized_project, tmp_path_factory, project_root, base_state):
    root, _ = quantized_project
    again = make_project(tmp_path_factory, project_root, base_state)
    execute("quantize", None, again)
    for name in ("models/quantize/model.safetensors", "models/quantize/config.json", "metrics/quantize_ranks.csv"):
        assert md5_file(again / name) == md5_file(root / name), name


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            {"rank_per_matrix": 1000},
            r"quantize.rank_per_matrix = 1000 gives a budget of 36000, over the total rank 13824 "
            r"of the 36 matrices",
        ),
        ({"modules": r"decoder\."}, r"quantize.modules: module regex 'decoder\\.' matches no nn.Linear"),
        (
            {"embeddings": "token_embed"},
            r"quantize.embeddings: embedding regex 'token_embed' matches no nn.Embedding.*"
            r"word_embeddings",
        ),
    ],
)
def test_bad_params_stop_and_leave_earlier_outputs(quantized_project, setting, message):
    root, _ = quantized_project
    before = output_hashes(root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    saved = dict(params["quantize"])
    params["quantize"].update(setting)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        with pytest.raises(ValueError, match=message):
            execute("quantize", None, root)
    finally:
        params["quantize"] = saved
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert output_hashes(root) == before


def test_invalid_module_regex_is_a_params_error(tiny_params):
    from tasks.runtime.params import ParamsError, validate_params

    data = tiny_params.model_dump()
    data["quantize"]["modules"] = r"encoder\.("
    with pytest.raises(ParamsError, match=r"quantize.modules.*not a valid regular expression"):
        validate_params(data, "params.yaml")


def test_bad_merged_model_is_refused_naming_the_file(tmp_path_factory, project_root, base_state):
    root = make_project(tmp_path_factory, project_root, base_state)
    model = root / "models" / "merge" / "model.safetensors"
    state = load_file(str(model))
    # a model of another architecture: a hidden size that does not fit
    save_file({**state, "encoder.layer.0.attention.self.query.weight": torch.zeros(128, 384)}, str(model))
    with pytest.raises(ValueError, match=r"models/merge/model.safetensors: does not fit the architecture"):
        execute("quantize", None, root)
    # NaN in a weight
    bad = {**state}
    bad["encoder.layer.2.output.dense.weight"] = bad["encoder.layer.2.output.dense.weight"].clone()
    bad["encoder.layer.2.output.dense.weight"][3, 4] = float("nan")
    save_file(bad, str(model))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'encoder.layer.2.output.dense.weight' of the merged "
        r"encoder has 1 NaN or inf values of 589824 \(first: nan at \[3, 4\]\)",
    ):
        execute("quantize", None, root)
    # truncated
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 3])
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: merged encoder is not a readable safetensors file, "
        r"truncated: tensor .*crucible stage merge",
    ):
        execute("quantize", None, root)
    # missing
    shutil.rmtree(root / "models" / "merge")
    with pytest.raises(FileNotFoundError, match=r"models/merge/model.safetensors: missing"):
        execute("quantize", None, root)
    assert not (root / "models" / "quantize").exists()
    assert not [p for n in METRIC_FILES for p in [root / "metrics" / n] if p.exists()]
