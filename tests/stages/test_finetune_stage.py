"""The finetune stage on the tiny profile: outputs, the saved model loads and predicts as trained,
determinism, bad params. (Byte-identical outputs beside another task's training and after a kill:
tests/stages/test_finetune_determinism.py.)"""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.stages import execute

torch.set_num_threads(1)
# the stage's outputs, relative to the workspace: the model under data/<task>/finetune/, the metrics
# under metrics/<task>/
OUTPUTS = (
    "data/rotten/finetune/model.safetensors",
    "data/rotten/finetune/head.safetensors",
    "data/rotten/finetune/config.json",
    "metrics/rotten/finetune.json",
)


def synthetic_tables(seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """labeled.parquet and test.parquet as pseudolabel and ingest write them, from templates (the
    upstream stages are tested elsewhere; running them here would triple this module's time)."""
    rng = np.random.default_rng(seed)
    words = {"fresh": ["wonderful", "moving", "brilliant", "charming"], "rotten": ["dull", "tedious", "awful", "messy"]}
    filler = ["the film", "this movie", "the plot", "its cast", "the ending", "every scene"]

    def text(label, end="too"):
        a, b = rng.choice(words[label]), rng.choice(words[label])
        return f"{rng.choice(filler)} is {a} and {b}, {rng.choice(filler)} {end}"

    rows = []
    for source, n, weight in (("reference", 40, 1.0), ("audit", 10, 0.8), ("pseudo", 30, 0.5)):
        for i in range(n):
            label = "fresh" if i % 2 == 0 else "rotten"
            rows.append(
                {
                    "id": f"{source}-{i}",
                    "text": text(label),
                    "label": label,
                    "source": source,
                    "confidence": 1.0 if source != "pseudo" else 0.9,
                    "weight": weight if i != 3 else 0.0,
                    # every fifth reference row is a dev row (4 of each class), as pseudolabel splits
                    "split": "dev" if source == "reference" and i % 5 == 0 else "train",
                }
            )
    labeled = pd.DataFrame(rows)
    labeled.loc[labeled["source"] == "reference", "weight"] = 1.0
    test = pd.DataFrame(
        [
            {"id": f"t{i}", "text": text(lab, end="as well"), "label": lab}  # no copy of a training text
            for i, lab in enumerate(["fresh", "rotten"] * 20)
        ]
    )
    return labeled, test


@pytest.fixture(scope="module")
def finetuned_project(tmp_path_factory, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("finetune"), "tiny")
    labeled, test = synthetic_tables()
    (root / "data" / "rotten").mkdir(parents=True)
    labeled.to_parquet(root / "data" / "rotten" / "labeled.parquet", index=False)
    test.to_parquet(root / "data" / "rotten" / "test.parquet", index=False)
    execute("finetune", "rotten", root)
    return root


def test_outputs_config_and_metrics(finetuned_project):
    base = finetuned_project / "data" / "rotten"
    for name in OUTPUTS:
        assert (finetuned_project / name).is_file(), name
    assert not (base / "finetune.json").exists()
    from tasks.stages.finetune import checkpoint_dir

    assert not checkpoint_dir(finetuned_project, "rotten").exists()  # removed after success
    assert not (base / ".finetune-checkpoints").exists()
    config = json.loads((base / "finetune" / "config.json").read_text())
    assert config["classes"] == ["fresh", "rotten"] and config["base_model"] == "all-MiniLM-L6-v2"
    assert config["finetune"]["method"] == "gmixout" and config["train"]["max_steps"] == 6
    metrics = json.loads((finetuned_project / "metrics" / "rotten" / "finetune.json").read_text())
    assert metrics["steps"] == 6 and 1 <= metrics["best_step"] <= 6
    assert 0 <= metrics["dev_accuracy"] <= 1 and 0 <= metrics["test_accuracy"] <= 1
    assert metrics["n_test"] == 40
    # no timings in the DVC-tracked file (its md5 would change on every run); they go to MLflow
    assert not {"examples_per_second", "steps_per_second", "train_seconds"} & set(metrics)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{finetuned_project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("crucible")
    run = client.search_runs([exp.experiment_id], "tags.`crucible.stage` = 'finetune'")[0]
    assert run.data.metrics["examples_per_second"] > 0 and run.data.params["torch_threads"] == str(
        torch.get_num_threads()
    )
    # where it ran (runtime.device auto): on the run and in the output's config
    from crucible.device import autocast_dtype, precision_name, resolve_device

    device = resolve_device("auto")
    precision = precision_name(autocast_dtype(device, "auto"))
    assert run.data.tags["crucible.runtime.device"] == str(device)
    assert run.data.tags["crucible.runtime.precision"] == precision
    assert config["runtime"] == {
        "device": device.type,
        "precision": precision,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda or "none"),
    }
    assert config["train"]["autocast"] == precision
    # the dev split is reference rows only, stratified
    assert metrics["n_dev"] == 8 and metrics["n_train"] == 80 - 8 - 2  # two rows of weight 0 dropped


def test_saved_model_loads_into_the_base_architecture_and_reproduces_the_dev_accuracy(finetuned_project):
    from crucible.embed import load_encoder
    from crucible.train import EncoderClassifier, evaluate
    from tasks.data.classifier import examples
    from tasks.data.models import resolve_model

    base = finetuned_project / "data" / "rotten"
    encoder, tokenizer = load_encoder(resolve_model("all-MiniLM-L6-v2"))
    state = load_file(str(base / "finetune" / "model.safetensors"))
    assert set(state) == set(encoder.state_dict())
    changed = [k for k, v in encoder.state_dict().items() if not torch.equal(v, state[k])]
    assert any(".layer.0.attention.self.query.weight" in k for k in changed)
    with safe_open(str(base / "finetune" / "head.safetensors"), framework="pt") as fh:
        classes = json.loads(fh.metadata()["classes"])
        head = {k: fh.get_tensor(k) for k in fh.keys()}
    assert head["weight"].shape == (2, encoder.config.hidden_size)
    model = EncoderClassifier(encoder, len(classes))
    model.encoder.load_state_dict(state)
    model.head.load_state_dict(head)
    labeled = pd.read_parquet(base / "labeled.parquet")
    dev = labeled[labeled["split"] == "dev"]
    acc = evaluate(model, examples(tokenizer, dev, classes, 32, use_weights=False))["accuracy"]
    metrics = json.loads((finetuned_project / "metrics" / "rotten" / "finetune.json").read_text())
    assert acc == pytest.approx(metrics["dev_accuracy"])


def test_rerun_is_byte_identical(finetuned_project):
    """The same stage run twice in one process (same thread count) writes the same bytes: model,
    head, config and metrics."""
    from tasks.runtime.io import md5_file

    before = {name: md5_file(finetuned_project / name) for name in OUTPUTS}
    execute("finetune", "rotten", finetuned_project)
    assert {name: md5_file(finetuned_project / name) for name in OUTPUTS} == before


def test_lp_ft_starts_the_head_as_the_probe_on_the_training_reference_rows(finetuned_project):
    """finetune.head_init: probe (the default): before any step, the head is crucible.heads'
    probe fitted on the frozen base model's pooled features of the training reference rows; random:
    nn.Linear's initialisation. The stage records the probe's C and its dev accuracy."""
    from crucible.heads import fit_linear_head
    from crucible.train import pooled_features
    from tasks.data.classifier import examples, prepare
    from tasks.data.models import base_model
    from tasks.runtime.params import load_params

    params = load_params(finetuned_project / "params.yaml")
    labeled = pd.read_parquet(finetuned_project / "data" / "rotten" / "labeled.parquet")
    rows = labeled[(labeled["source"] == "reference") & (labeled["split"] == "train")]
    base = base_model(params, finetuned_project)
    model, tokenizer, gm, max_length, lp = prepare(base, ["fresh", "rotten"], params.finetune, 3, rows, 32)
    gm.unwrap()
    ex = examples(tokenizer, rows, ["fresh", "rotten"], max_length, use_weights=False)
    x = pooled_features(model, ex.input_ids, pad_id=tokenizer.pad_token_id or 0).numpy()
    from crucible.seeding import stream_seed

    again = fit_linear_head(x, ex.labels.numpy(), 2, seed=stream_seed(3, "probe"))
    np.testing.assert_allclose(model.head.weight.detach().numpy(), again.weight, atol=1e-6)
    np.testing.assert_allclose(model.head.bias.detach().numpy(), again.bias, atol=1e-6)
    assert lp.C == again.C
    random = prepare(base, ["fresh", "rotten"], params.finetune.model_copy(update={"head_init": "random"}), 3, rows, 32)
    assert random[4] is None and not torch.allclose(random[0].head.weight, model.head.weight)
    config = json.loads((finetuned_project / "data" / "rotten" / "finetune" / "config.json").read_text())
    metrics = json.loads((finetuned_project / "metrics" / "rotten" / "finetune.json").read_text())
    assert config["probe_C"] in (0.01, 0.1, 1.0, 10.0, 100.0) and 0 <= metrics["probe_dev_accuracy"] <= 1


def test_labeled_rows_without_a_split_are_refused(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny")
    labeled, test = synthetic_tables()
    (root / "data" / "rotten").mkdir(parents=True)
    labeled.drop(columns="split").to_parquet(root / "data" / "rotten" / "labeled.parquet", index=False)
    test.to_parquet(root / "data" / "rotten" / "test.parquet", index=False)
    with pytest.raises(ValueError, match=r"labeled.parquet.*split"):
        execute("finetune", "rotten", root)
    labeled.assign(split=np.where(labeled["source"] == "pseudo", "dev", labeled["split"])).to_parquet(
        root / "data" / "rotten" / "labeled.parquet", index=False
    )
    with pytest.raises(ValueError, match=r"column 'split', row 50: got 'dev' \(source 'pseudo'\)"):
        execute("finetune", "rotten", root)


def test_unknown_finetune_param_is_rejected(project_root):
    from tasks.runtime.params import ParamsError, validate_params

    data = yaml.safe_load((project_root / "params.yaml").read_text())
    data["finetune"]["gmixout"]["p"] = 1.0
    with pytest.raises(ParamsError, match="finetune.gmixout.p"):
        validate_params(data, "params.yaml")
    data["finetune"]["gmixout"]["p"] = 0.5
    data["finetune"]["gmixout"]["anchr"] = "ema"
    with pytest.raises(ParamsError, match="did you mean 'finetune.gmixout.anchor'"):
        validate_params(data, "params.yaml")


def test_logged_pyfunc_predicts_like_the_stage(finetuned_project, tmp_path):
    """The MLflow model of the run loads on its own and answers a DataFrame of texts as the trained
    encoder + head do (the same predictions as the stage's own test accuracy)."""
    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{finetuned_project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("crucible")
    runs = client.search_runs(
        [exp.experiment_id], "tags.`crucible.stage` = 'finetune' and attributes.status = 'FINISHED'"
    )
    assert runs, "no finished finetune run"
    # no mlflow.set_tracking_uri: it sets MLFLOW_TRACKING_URI for the whole process and its children
    local = client.download_artifacts(runs[0].info.run_id, "model", str(tmp_path))
    model = mlflow.pyfunc.load_model(local)
    test = pd.read_parquet(finetuned_project / "data" / "rotten" / "test.parquet")
    out = model.predict(test[["text"]])
    assert list(out.columns) == ["label", "proba_fresh", "proba_rotten"]
    assert np.allclose(out[["proba_fresh", "proba_rotten"]].sum(axis=1), 1.0, atol=1e-5)
    metrics = json.loads((finetuned_project / "metrics" / "rotten" / "finetune.json").read_text())
    assert (out["label"] == test["label"]).mean() == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    text = open(f"{local}/requirements.txt").read()
    assert "torch==" in text and "transformers==" in text
    # logged from code, not pickled (tests/stages/test_no_pickle.py checks every file and a pickle-free load)
    flavor = yaml.safe_load((Path(local) / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["model_code_path"].endswith("pyfunc.py") and "python_model" not in flavor
    assert flavor["config"] == {"crucible_model": "TextClassifier"}
    assert not [p for p in Path(local).rglob("*") if p.suffix in (".pkl", ".pickle", ".cloudpickle")]
    assert type(model.unwrap_python_model()).__module__.startswith("code_model_")
