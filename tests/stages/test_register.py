"""The register stage on a real quantize output (the quantize stage run on a synthetic merged model,
as in test_quantize_stage): the gate never moves `champion` to a worse model and says why, a rerun
of the same model registers nothing, the pyfunc round-trips through the registry into a fresh
process, the quantized pyfunc scores the quantize stage's figure, lineage tags equal dvc.lock.

The workspaces are built once per test session (tests/support/workspaces.py) and shared with
test_serve.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from support.workspaces import (
    _dvc,
    as_written_by,
    base_workspace,
    copy_workspace,
    registered_workspace,
    test_texts,
    write_evaluate,
)

from tasks.stages import execute


def client_of(root: Path):
    from tasks.registry.serving import registry_client

    return registry_client(root)


def registered(root: Path) -> dict:
    return json.loads((root / "metrics" / "registered.json").read_text())


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return registered_workspace(tmp_path_factory)


@pytest.fixture(scope="module")
def champion(ws):
    from tasks.registry.serving import load_registered

    return load_registered(ws, "champion")


# ---------------------------------------------------------------------------------------------------
# the gate


def _bump_heads(root: Path, delta: float) -> None:
    """A different model (new hash): the heads' biases moved a little."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = root / "models" / "quantize" / "heads.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    heads = load_file(str(path))
    save_file(
        {k: (v + delta if k.endswith(".bias") else v).contiguous() for k, v in heads.items()}, str(path), metadata=meta
    )
    as_written_by(root, "quantize", "models/quantize/heads.safetensors")  # as a rerun of quantize would


@pytest.mark.long
def test_gate_never_moves_champion_to_a_worse_model(tmp_path_factory):
    """Three versions: a first (champion), a better (champion moves), a significantly worse one on the
    same rows (challenger, with the reason and the intervals as tags; champion stays). A rerun of the
    same model registers nothing."""
    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "gate")
    client = client_of(root)
    name = "crucible-classifier"

    write_evaluate(root, {"rotten": 0.6, "bbc": 0.5})
    execute("register", None, root)
    first = registered(root)
    assert first["version"] == 1 and first["new_version"] and first["aliases"] == ["champion"]
    assert first["gate"]["reason"].startswith("first version")
    assert first["gate"]["vs_champion"] is None and set(first["gate"]["vs_probe"]) == {"rotten", "bbc", "mean"}

    _bump_heads(root, 1e-3)
    write_evaluate(root, {"rotten": 0.9, "bbc": 0.8})
    execute("register", None, root)
    better = registered(root)
    assert better["version"] == 2 and better["gate"]["decision"] == "champion"
    assert better["gate"]["champion_before"] == 1 and better["gate"]["champion_after"] == 2
    assert int(client.get_model_version_by_alias(name, "champion").version) == 2
    # compared with the champion's stored predictions on the same rows: version 1 was right on fewer
    vs = better["gate"]["vs_champion"]
    assert str(vs["version"]) == "1" and "as stored when it was registered" in vs["note"]
    assert vs["comparison"]["rotten"]["a"] == pytest.approx(0.9, abs=0.03) and vs["comparison"]["mean"]["diff"] > 0

    _bump_heads(root, 1e-3)
    write_evaluate(root, {"rotten": 0.3, "bbc": 0.3})  # right on 7 of 24 rows where the champion was on 22 and 19
    execute("register", None, root)
    worse = registered(root)
    assert worse["version"] == 3 and worse["new_version"] and worse["aliases"] == ["challenger"]
    assert worse["gate"]["decision"] == "challenger" and worse["gate"]["champion_after"] == 2
    assert int(client.get_model_version_by_alias(name, "champion").version) == 2
    v3 = client.get_model_version(name, "3")
    assert v3.tags["crucible.gate.decision"] == "challenger"
    assert "vs champion version 2's" in v3.tags["crucible.gate.reason"]
    record = json.loads(v3.tags["crucible.gate.record"])
    assert record["vs_champion"]["comparison"]["mean"]["ci_high"] < 0
    assert record["vs_probe"]["mean"]["ci_low"] > 0  # still above the probe: only the champion stops it
    from tasks.registry.gate import rule

    assert v3.tags["crucible.gate.rule"] == rule(True, 0.0)
    assert client.get_model_version(name, "2").aliases == ["champion"]
    assert client.get_model_version(name, "1").tags["crucible.gate.superseded_by"] == "2"

    # nothing changed, forced: the stage notices the same model hash and registers nothing
    execute("register", None, root)
    again = registered(root)
    assert not again["new_version"] and again["version"] == 3
    assert "already registered as version 3" in again["note"] and again["model_hash"] == worse["model_hash"]
    assert len(client.search_model_versions(f"name = '{name}'")) == 3
    assert int(client.get_model_version_by_alias(name, "champion").version) == 2


@pytest.mark.long
def test_a_champion_without_stored_predictions_scores_the_rows_itself(tmp_path_factory):
    """A champion registered before its predictions were stored (or for other test rows) is loaded
    from the registry and scores this version's rows in the process."""
    from tasks.registry.gate import PREDICTIONS_ARTIFACT

    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "rescore")
    client = client_of(root)
    write_evaluate(root, {"rotten": 0.6, "bbc": 0.5})
    execute("register", None, root)
    run_id = registered(root)["run_id"]
    stored = Path(client.download_artifacts(run_id, PREDICTIONS_ARTIFACT, str(root / "tmp-dl")))
    (Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://")) / PREDICTIONS_ARTIFACT).unlink()
    assert stored.is_file()
    _bump_heads(root, 1e-3)
    write_evaluate(root, {"rotten": 0.7, "bbc": 0.6})
    execute("register", None, root)
    vs = registered(root)["gate"]["vs_champion"]
    assert "scored now by the champion model" in vs["note"]
    assert vs["comparison"]["mean"]["n"] == 48  # every test row of both tasks, scored by version 1


@pytest.mark.long
def test_an_experiment_or_promote_false_never_moves_the_champion(tmp_path_factory, monkeypatch):
    """Under `dvc exp run` (DVC_EXP_NAME set) a better model is registered and gated but stays the
    challenger, with the experiment and the work tree's state in its tags; so with
    register.promote: false. Without either the same model then becomes the champion."""
    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "experiment")
    client = client_of(root)
    name = "crucible-classifier"
    write_evaluate(root, {"rotten": 0.6, "bbc": 0.5})
    execute("register", None, root)
    assert registered(root)["aliases"] == ["champion"]

    _bump_heads(root, 1e-3)
    write_evaluate(root, {"rotten": 0.9, "bbc": 0.8})  # better: the gate would pass
    monkeypatch.setenv("DVC_EXP_NAME", "lr-sweep-3")
    execute("register", None, root)
    exp = registered(root)
    assert exp["version"] == 2 and exp["aliases"] == ["challenger"] and exp["experiment"] == "lr-sweep-3"
    assert exp["gate"]["decision"] == "challenger" and exp["gate"]["champion_after"] == 1
    assert exp["gate"]["reason"].startswith("not promoted: DVC experiment 'lr-sweep-3'")
    assert "the gate would pass" in exp["gate"]["reason"]
    v2 = client.get_model_version(name, "2")
    assert v2.tags["crucible.experiment"] == "lr-sweep-3" and v2.tags["crucible.git_dirty"] in (
        "true",
        "false",
        "unknown",
    )
    assert int(client.get_model_version_by_alias(name, "champion").version) == 1

    monkeypatch.delenv("DVC_EXP_NAME")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["register"]["promote"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _bump_heads(root, 1e-3)
    execute("register", None, root)
    held = registered(root)
    assert held["version"] == 3 and held["aliases"] == ["challenger"] and held["experiment"] is None
    assert held["gate"]["reason"].startswith("not promoted: register.promote is false")
    assert int(client.get_model_version_by_alias(name, "champion").version) == 1

    params["register"]["promote"] = True  # the same model, promotable: it passes and moves the champion
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    execute("register", None, root)
    assert registered(root)["aliases"] == ["champion"]
    assert int(client.get_model_version_by_alias(name, "champion").version) == 3


def comparison(a: float, b: float, lo: float, hi: float) -> dict:
    return {"a": a, "b": b, "diff": a - b, "ci_low": lo, "ci_high": hi}


def test_gate_rule():
    """Floors set in params, each task not significantly below the probe, the mean significantly
    above it (require_gain), and not significantly below the champion on the same rows."""
    from tasks.registry.gate import gate, rule

    probe = {"a": comparison(0.8, 0.7, 0.02, 0.18), "b": comparison(0.6, 0.62, -0.08, 0.04)}
    probe["mean"] = comparison(0.7, 0.66, 0.005, 0.075)
    d = gate({"a": 0.8, "b": 0.6}, {}, probe, None, tolerance=0.0, require_gain=True)
    assert d.passed and d.reason.startswith("first version: task mean 0.7000 vs the probe's 0.6600, +0.0400")
    # b below the probe beyond its interval: refused, naming the task and the interval
    bad = {**probe, "b": comparison(0.55, 0.62, -0.12, -0.02)}
    d = gate({"a": 0.8, "b": 0.55}, {}, bad, None, tolerance=0.0, require_gain=True)
    assert not d.passed and d.reason == "task b: 0.5500 vs the probe's 0.6200, -0.0700 [-0.1200, -0.0200]"
    # a mean gain whose interval reaches 0: refused with require_gain, passed without
    flat = {**probe, "mean": comparison(0.7, 0.69, -0.01, 0.03)}
    assert not gate({"a": 0.8, "b": 0.6}, {}, flat, None, tolerance=0.0, require_gain=True).passed
    assert gate({"a": 0.8, "b": 0.6}, {}, flat, None, tolerance=0.0, require_gain=False).passed
    # a set floor
    d = gate({"a": 0.8, "b": 0.6}, {"b": 0.61}, probe, None, tolerance=0.0, require_gain=True)
    assert not d.passed and d.reason == "task b: accuracy 0.6000 vs its floor 0.6100"
    # the champion: replaced unless significantly better than the new version on the same rows
    champ = {"version": "4", "comparison": {"mean": comparison(0.70, 0.72, -0.05, 0.01)}, "note": "on 400 rows"}
    d = gate({"a": 0.8, "b": 0.6}, {}, probe, champ, tolerance=0.0, require_gain=True)
    assert d.passed and d.reason.startswith("champion version 4 replaced (on 400 rows)")
    champ["comparison"]["mean"] = comparison(0.70, 0.74, -0.06, -0.01)
    d = gate({"a": 0.8, "b": 0.6}, {}, probe, champ, tolerance=0.0, require_gain=True)
    assert not d.passed and "vs champion version 4's 0.7400 on the same rows, -0.0400 [-0.0600, -0.0100]" in d.reason
    assert gate({"a": 0.8, "b": 0.6}, {}, probe, champ, tolerance=0.02, require_gain=True).passed
    # a champion of other tasks is not compared
    other = {"version": "4", "comparison": None, "note": "not compared"}
    assert gate({"a": 0.8, "b": 0.6}, {}, probe, other, tolerance=0.0, require_gain=True).passed
    assert "not significantly below the champion" in rule(True, 0.0) and "lower end > 0" in rule(True, 0.0)
    assert "lower end > 0" not in rule(False, 0.0)


def test_set_floors_for_an_unknown_task_are_refused(ws):
    from tasks.runtime.params import load_params
    from tasks.stages.register import set_floors

    params = load_params(ws / "params.yaml")
    assert set_floors(params, ["rotten", "bbc"]) == {}  # none by default: the gate's intervals decide
    section = params.register.model_copy(update={"floors": {"tweets": 0.5}})
    with pytest.raises(ValueError, match=r"register.floors names tasks \['tweets'\].*its tasks: rotten, bbc"):
        set_floors(params.model_copy(update={"register": section}), ["rotten", "bbc"])
    section = params.register.model_copy(update={"floor": 0.3, "floors": {"bbc": 0.8}})
    assert set_floors(params.model_copy(update={"register": section}), ["rotten", "bbc"]) == {"rotten": 0.3, "bbc": 0.8}


def test_a_model_no_better_than_the_probe_is_a_challenger_with_the_reason(tmp_path_factory):
    """A model that does not beat the frozen-base probe (the tiny profile's 6 fine-tuning steps) is
    registered as the challenger, not the champion, and the reason names the interval; with
    require_gain: false and no task significantly below the probe it passes (the gate re-applied to
    the same version)."""
    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "probe")
    write_evaluate(root, {"rotten": 0.5, "bbc": 0.5}, probe_accuracy=0.5)
    execute("register", None, root)
    got = registered(root)
    assert got["version"] == 1 and got["aliases"] == ["challenger"] and got["gate"]["decision"] == "challenger"
    reason = got["gate"]["reason"]
    assert reason.startswith("task mean 0.5000 vs the probe's 0.5000, +0.0000 [+0.0000, +0.0000]")
    mv = client_of(root).get_model_version("crucible-classifier", "1")
    assert mv.tags["crucible.gate.reason"] == reason
    record = json.loads(mv.tags["crucible.gate.record"])
    assert record["vs_probe"]["rotten"]["n"] == 24 and "rule" in record
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["register"]["require_gain"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    execute("register", None, root)
    got = registered(root)
    assert not got["new_version"] and got["aliases"] == ["champion"], got["gate"]


def test_a_broken_model_config_names_the_file(tmp_path_factory):
    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "badconfig")
    (root / "models" / "quantize" / "config.json").write_text('{"classes": ')
    as_written_by(root, "quantize", "models/quantize/config.json")  # quantize's own output: read_model's check
    with pytest.raises(ValueError, match=r"models/quantize/config\.json: not valid JSON .*crucible stage quantize"):
        execute("register", None, root)
    assert not (root / "metrics" / "registered.json").exists()


def test_evaluate_metrics_are_checked(tmp_path):
    from tasks.stages.register import read_deployable, read_value

    with pytest.raises(FileNotFoundError, match=r"metrics/evaluate.json: missing.*evaluate stage"):
        read_deployable(tmp_path, "quantized", ["rotten", "bbc"])
    (tmp_path / "metrics").mkdir()
    entry = {"variant": "gs3r", "accuracy": {"rotten": 0.7}, "mean_accuracy": 0.7, "n_test": {"rotten": 24}}
    (tmp_path / "metrics" / "evaluate.json").write_text(json.dumps({"deployable": {"float": entry}}))
    with pytest.raises(ValueError, match=r"'deployable.float.accuracy' has no figure for tasks \['bbc'\]"):
        read_deployable(tmp_path, "float", ["rotten", "bbc"])
    got = read_deployable(tmp_path, "float", ["rotten"])
    assert got["variant"] == "gs3r" and got["accuracy"] == {"rotten": 0.7} and got["n_test"] == {"rotten": 24}
    with pytest.raises(ValueError, match=r"no 'value.comparisons.float_vs_probe' for tasks \['rotten'\]"):
        read_value(tmp_path, "float", ["rotten"])


# ---------------------------------------------------------------------------------------------------
# the pyfunc


def test_pyfunc_round_trips_through_the_registry_into_a_fresh_process(ws, champion, tmp_path):
    """models:/<name>@champion loads in a new interpreter from the registry alone (its own code and
    weights) and predicts exactly what the in-process model predicts on every task's test texts."""
    model, mv = champion
    texts = test_texts(ws)
    inputs = tmp_path / "in.parquet"
    texts[["text", "task"]].to_parquet(inputs)
    script = (
        "import sys, mlflow.pyfunc, pandas as pd\n"
        "m = mlflow.pyfunc.load_model('models:/crucible-classifier@champion')\n"
        "assert type(m.unwrap_python_model()).__module__.startswith('code_model_'), 'not the logged code'\n"
        "m.predict(pd.read_parquet(sys.argv[1])).to_json(sys.argv[2], orient='records')\n"
    )
    uri = f"sqlite:///{ws / 'mlflow.db'}"
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(inputs), str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = pd.DataFrame(json.loads(out.read_text()))
    local = model.predict(texts[["text", "task"]])
    assert (
        list(fresh.columns)
        == list(local.columns)
        == ["task", "label", "proba_fresh", "proba_rotten", "proba_business", "proba_sport", "proba_tech"]
    )
    assert fresh["label"].tolist() == local["label"].tolist() and fresh["task"].tolist() == texts["task"].tolist()
    for c in [c for c in local.columns if c.startswith("proba_")]:
        a, b = local[c].astype(float).to_numpy(), fresh[c].astype(float).to_numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.allclose(a[~np.isnan(a)], b[~np.isnan(b)], atol=1e-6), c
    # each row's own task's probabilities sum to 1, the other task's cells are empty
    rotten = local[texts["task"] == "rotten"]
    assert np.allclose(rotten[["proba_fresh", "proba_rotten"]].astype(float).sum(1), 1.0)
    assert rotten["proba_sport"].isna().all()
    # the logged model carries its signature, input example, code and pinned requirements
    from mlflow.models import Model

    local_dir = Path(mv.source.removeprefix("file://"))
    meta = Model.load(str(local_dir / "MLmodel"))
    assert [c["name"] for c in meta.signature.inputs.to_dict()] == ["text", "task"]
    assert (local_dir / "input_example.json").is_file() and (local_dir / "code" / "crucible" / "quant").is_dir()
    requirements = (local_dir / "requirements.txt").read_text()
    assert "torch==" in requirements and "transformers==" in requirements and "mlflow==" in requirements


def test_quantized_pyfunc_scores_the_quantize_stage_figure(ws, champion):
    """The served model is the packed MXFP4 one with the deployed heads: rebuilt from its own
    artifacts, on the quantize stage's test rows it scores exactly the stage's deployed accuracy;
    its weights are a fraction of the float."""
    from crucible.quant import MXLinear

    model, mv = champion
    inner = model.unwrap_python_model()
    assert sum(isinstance(m, MXLinear) for m in inner.encoder.modules()) == 36
    stage = json.loads((ws / "metrics" / "quantize.json").read_text())
    for t in ("rotten", "bbc"):
        test = pd.read_parquet(ws / "data" / t / "test.parquet")  # quantize scores every test row
        out = model.predict(pd.DataFrame({"text": test["text"], "task": t}))
        assert (out["label"].to_numpy() == test["label"].to_numpy()).mean() == pytest.approx(
            stage["deployed_accuracy"][t], abs=1e-6
        )
    served, flt = int(mv.tags["crucible.size.served_bytes"]), int(mv.tags["crucible.size.float_bytes"])
    assert served < 0.2 * flt
    assert registered(ws)["size_bytes"]["served"] == served


def test_float_pyfunc_scores_the_float_figure(ws, tmp_path):
    """register.model: float packages the merged float encoder; it scores the quantize stage's
    float figure."""
    import mlflow.pyfunc

    from tasks.data.models import resolve_model
    from tasks.registry.pyfunc import save_multitask_model

    example = pd.DataFrame({"text": ["a film", "a market"], "task": ["rotten", "bbc"]})
    save_multitask_model(
        tmp_path / "float", ws / "models" / "merge", "float", resolve_model("all-MiniLM-L6-v2"), example
    )
    model = mlflow.pyfunc.load_model(str(tmp_path / "float"))
    stage = json.loads((ws / "metrics" / "quantize.json").read_text())
    for t in ("rotten", "bbc"):
        test = pd.read_parquet(ws / "data" / t / "test.parquet")
        out = model.predict(pd.DataFrame({"text": test["text"], "task": t}))
        assert (out["label"] == test["label"]).mean() == pytest.approx(stage["accuracy"]["float"][t], abs=1e-6)


@pytest.mark.parametrize(
    "frame, message",
    [
        (pd.DataFrame({"text": ["a film"]}), r"input is missing column 'task'.*one of: rotten, bbc"),
        (
            pd.DataFrame({"text": ["a film"], "task": ["tweets"]}),
            r"row 0: unknown task 'tweets'; valid tasks: rotten, bbc",
        ),
        (pd.DataFrame({"text": ["a film", "  "], "task": ["rotten", "rotten"]}), r"row 1: column 'text' is empty"),
        (
            pd.DataFrame({"text": ["a film", 7], "task": ["rotten", "bbc"]}),
            r"row 1: column 'text' must be a string, got int",
        ),
        (
            pd.DataFrame({"text": ["a film", None], "task": ["rotten", "bbc"]}),
            r"row 1: column 'text' is missing \(null\)",
        ),
    ],
)
def test_bad_input_is_a_clear_invalid_parameter_error(champion, frame, message):
    from mlflow.exceptions import MlflowException

    model, _ = champion
    with pytest.raises(MlflowException, match=message) as info:
        model.predict(frame)
    assert info.value.error_code == "INVALID_PARAMETER_VALUE" and info.value.get_http_status_code() == 400


# ---------------------------------------------------------------------------------------------------
# lineage


def test_lineage_tags_equal_dvc_lock(ws, capsys):
    from flows.cli import build_parser
    from tasks.registry import lineage

    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    mv = client_of(ws).get_model_version("crucible-classifier", "1")
    recorded = {k[len(lineage.MD5) :]: v for k, v in mv.tags.items() if k.startswith(lineage.MD5)}
    assert recorded == {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", [])}
    assert "models/quantize/model.safetensors" in recorded and any(v.endswith(".dir") for v in recorded.values())
    for sid in ("merge", "quantize", "evaluate"):
        assert json.loads(mv.tags[lineage.params_key(sid)]) == lock[sid]["params"]["params.yaml"]
    from tasks.runtime.tracking import git_commit

    assert mv.tags[lineage.COMMIT] == git_commit(ws)
    # write_evaluate's model: right on round(0.6 x 24) = 14 rotten rows and 12 bbc rows of 24
    assert float(mv.tags["crucible.metric.mean_accuracy"]) == pytest.approx((14 / 24 + 12 / 24) / 2)
    assert mv.tags["crucible.metric.accuracy.bbc"] == "0.5"

    def lineage_cli(ref: str) -> tuple[int, str]:
        args = build_parser().parse_args(["lineage", ref, "--root", str(ws)])
        code = args.func(args)
        return code, capsys.readouterr().out

    code, out = lineage_cli("champion")
    assert code == 0 and "workspace matches" in out and "models/quantize/model.safetensors" in out
    # DVC agrees the stage is recorded: after `dvc commit register` it is up to date
    _dvc(ws, "commit", "--force", "register")
    assert json.loads(_dvc(ws, "status", "register", "--json").stdout or "{}") == {}
    # a changed artifact is reported, against the disk
    target = ws / "metrics" / "quantize.json"
    saved = target.read_bytes()
    try:
        target.write_bytes(saved + b" ")
        code, out = lineage_cli("1")
        assert code == 1 and "workspace differs" in out
        assert [line for line in out.splitlines() if line.startswith("metrics/quantize.json")][0].endswith(
            "match     differs"
        )
    finally:
        target.write_bytes(saved)
    code, out = lineage_cli("7")
    assert code == 2


def test_dir_hash_is_dvcs(ws):
    from tasks.registry.lineage import dir_md5

    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    dirs = {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", []) if o["md5"].endswith(".dir")}
    assert dirs
    for path, md5 in dirs.items():
        assert dir_md5(ws / path) == md5, path


# ---------------------------------------------------------------------------------------------------
# a workspace that stands alone, a store that is lost, a register that is killed


@pytest.mark.long
def test_a_copied_workspace_serves_its_own_files_after_the_original_is_deleted(tmp_path_factory, capsys):
    """Copy a workspace that registered a champion (as `cp -a` would), delete the original: the copy's
    store points at its own mlartifacts/, the champion loads and predicts from there, and a run in the
    copy writes there. Then delete the copy's mlflow.db: the next register warns that version 1
    (champion) was lost, and says so in registered.json."""
    import shutil

    from tasks.registry.serving import load_registered

    original = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "original")
    execute("register", None, original)
    texts = test_texts(original)
    expected = load_registered(original, "champion")[0].predict(texts[["text", "task"]])
    copy = tmp_path_factory.mktemp("moved") / "ws"
    shutil.copytree(original, copy, symlinks=True)
    shutil.rmtree(original)
    capsys.readouterr()
    model, mv = load_registered(copy, "champion")
    assert "this workspace was copied or moved from" in capsys.readouterr().err
    assert mv.source.startswith((copy / "mlartifacts").as_uri() + "/")
    served = model.predict(texts[["text", "task"]])
    assert served["label"].tolist() == expected["label"].tolist()
    assert client_of(copy).get_experiment_by_name("crucible").artifact_location == (copy / "mlartifacts").as_uri()

    (copy / "mlflow.db").unlink()
    # a fresh process, as in use (this one keeps MLflow's handle on the deleted database)
    out = subprocess.run(
        [str(Path(sys.executable).with_name("crucible")), "stage", "register", "--root", str(copy)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "registered version 1 of 'crucible-classifier' (aliases: champion) before" in out.stderr  # opening the store
    assert "register: warning: the registry holds no version of 'crucible-classifier'" in out.stderr
    got = registered(copy)
    assert got["version"] == 1 and got["new_version"]
    assert got["lost_registry"].startswith(
        f"the registry holds no version of 'crucible-classifier', but "
        f"{copy / 'metrics' / 'registered.json'} records version 1 "
        f"(champion)"
    )
    assert "warning: the registry holds no version" in got["note"]


def test_a_register_killed_while_it_logs_the_model_leaves_nothing_half_made(tmp_path_factory):
    """SIGKILL `crucible stage register` once its logged model exists (before it is registered): the
    next register removes that model (and its files) and registers a version of its own."""
    import signal
    import sqlite3
    import time

    root = copy_workspace(base_workspace(tmp_path_factory), tmp_path_factory, "killed")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("crucible")), "stage", "register", "--root", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    model_id, deadline = None, time.time() + 240
    try:
        while model_id is None and time.time() < deadline and proc.poll() is None:
            try:
                with sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True, timeout=5) as con:
                    row = con.execute("SELECT model_id FROM logged_models").fetchone()
                model_id = row[0] if row else None
            except sqlite3.Error:
                pass
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert model_id, f"the register never logged its model: {proc.stderr.read()[-2000:]}"
    client = client_of(root)
    assert not client.search_model_versions("name = 'crucible-classifier'")  # killed before registering
    folder = root / "mlartifacts" / "models" / model_id

    execute("register", None, root)
    with sqlite3.connect(root / "mlflow.db") as con:
        stage = con.execute("SELECT lifecycle_stage FROM logged_models WHERE model_id = ?", (model_id,)).fetchone()[0]
    assert stage == "deleted" and not folder.exists()
    got = registered(root)
    assert got["version"] == 1 and got["new_version"]
    assert client.get_model_version("crucible-classifier", "1").model_id != model_id


# ---------------------------------------------------------------------------------------------------
# a broken model is never registered


def _full_copy(ws: Path, tmp_path_factory, name: str) -> Path:
    """A copy of the registered workspace, artifacts and all (its champion, version 1, loads there)."""
    import shutil

    dest = tmp_path_factory.mktemp(name) / "ws"
    shutil.copytree(ws, dest, symlinks=True)
    return dest


def _register_cli(root: Path, capsys) -> tuple[int, list[str]]:
    """`crucible stage register` in `root`: its exit status and its `error:` lines."""
    from flows.cli import build_parser

    capsys.readouterr()
    args = build_parser().parse_args(["stage", "register", "--root", str(root)])
    code = args.func(args)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _registry(root: Path) -> list[tuple[str, list[str]]]:
    client = client_of(root)
    return [(str(v.version), sorted(client.get_model_version(v.name, v.version).aliases)) for v in _versions(client)]


def _versions(client) -> list:
    from tasks.registry.registry import versions

    return versions(client, "crucible-classifier")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_model_that_dvc_lock_knows_is_refused_and_nothing_is_registered(ws, tmp_path_factory, capsys):
    """models/quantize/model.safetensors cut in half after quantize ran (dvc.lock holds its md5): register
    exits 2 with one line naming the file, both hashes and the stage to rerun, before it writes
    anything: no version is created, no alias moves, registered.json stays."""
    root = _full_copy(ws, tmp_path_factory, "truncated")
    before, summary = _registry(root), (root / "metrics" / "registered.json").read_bytes()
    assert before == [("1", ["champion"])]
    _truncate(root / "models" / "quantize" / "model.safetensors")
    code, errors = _register_cli(root, capsys)
    assert code == 2 and len(errors) == 1, errors
    model = root / "models" / "quantize" / "model.safetensors"
    assert errors[0].startswith(f"error: stage register: {model}: md5 ")
    assert " is not what stage quantize wrote (dvc.lock records " in errors[0]
    assert errors[0].endswith("rebuild it with `crucible stage quantize` (or `dvc repro quantize`)")
    assert _registry(root) == before and (root / "metrics" / "registered.json").read_bytes() == summary


def test_a_truncated_model_with_no_record_to_check_fails_to_load_and_nothing_is_registered(
    ws, tmp_path_factory, capsys
):
    """No dvc.lock and no record of quantize's run (nothing to compare the hash with): the model that
    register is about to log is loaded in a fresh process, as serving would, fails, and the stage
    exits 2 naming the file; no version is created and no alias moves."""
    import shutil

    from tasks.runtime.lockcheck import RECORDS

    root = _full_copy(ws, tmp_path_factory, "unloadable")
    (root / "dvc.lock").unlink()
    shutil.rmtree(root / RECORDS)
    before = _registry(root)
    model = root / "models" / "quantize" / "model.safetensors"
    _truncate(model)
    code, errors = _register_cli(root, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: stage register: {model}: ") and "not a readable safetensors file" in errors[0]
    assert "does not load and predict in a fresh process as serving would, so nothing was registered" in errors[0]
    assert errors[0].endswith("rebuild it with `crucible stage quantize` (or `dvc repro quantize`)")
    assert _registry(root) == before == [("1", ["champion"])]
