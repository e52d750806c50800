"""The classifier stages end to end on a base model other than MiniLM: a tiny random model of a
family (saved as a local folder, tests/support/tiny_models.py) named in `model.name`, through the
model stage, finetune (two tasks), merge, quantize, evaluate and register, and the registered
champion loaded in a fresh process. Families: DeBERTa-v2 (attention dropout of its own), ModernBERT
(blocks at `layers.N`) and Llama (a decoder: no pad token, last-token pooling). Every family goes
through the same steps at library level in tests/library/test_model_families.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from support.tiny_models import DECODERS, save_tiny

from tasks.stages import execute

torch.set_num_threads(1)
LABELS = {"rotten": ["fresh", "rotten"], "bbc": ["business", "sport"]}
CUES = {
    "fresh": "good great win",
    "rotten": "bad awful loss",
    "business": "market price chip",
    "sport": "goal team win",
}
FILLER = ["the", "a", "film", "plot", "actor", "phone", "vote", "is", "was"]


def tables(task: str, seed: int) -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(seed)

    def text(label, i, kind):
        return f"{' '.join(rng.choice(FILLER, 3))} {CUES[label]} {' '.join(rng.choice(FILLER, 2))} {kind}{i}"

    classes = LABELS[task]
    reference = pd.DataFrame(
        [{"id": f"r{i}", "text": text(classes[i % 2], i, "r"), "label": classes[i % 2]} for i in range(24)]
    )
    labeled = reference.assign(source="reference", confidence=1.0, weight=1.0)
    labeled["split"] = ["dev" if i % 4 == 0 else "train" for i in range(len(labeled))]  # as pseudolabel writes
    pseudo = pd.DataFrame(
        [
            {
                "id": f"p{i}",
                "text": text(classes[i % 2], i, "p"),
                "label": classes[i % 2],
                "source": "pseudo",
                "confidence": 0.9,
                "weight": 0.5,
                "split": "train",
            }
            for i in range(16)
        ]
    )
    test = pd.DataFrame(
        [{"id": f"t{i}", "text": text(classes[i % 2], i, "t"), "label": classes[i % 2]} for i in range(16)]
    )
    pool = pd.DataFrame([{"id": f"q{i}", "text": text(classes[i % 2], i, "q")} for i in range(8)])
    labeled = pd.concat([labeled, pseudo], ignore_index=True)
    return {"reference": reference, "labeled": labeled, "test": test, "pool": pool}


@pytest.mark.parametrize("family", ["deberta-v2", "modernbert", "llama"])
@pytest.mark.long
def test_stages_end_to_end_on_a_local_model_folder(family, tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    folder = save_tiny(family, tmp_path / "base-model")
    over = {
        "model": {"name": str(folder)},
        "merge": {
            "methods": {"gs3r": None, "ties": None, "magmax": None, "opcm": None, "weight_average": None},
            "main": "task_arithmetic",
            "eval_limit": 16,
        },
        "quantize": {"calibration_per_task": 8},
        "finetune": {"max_steps": 4, "max_length": 16},
        # a random tiny model is at chance: the registry path (the registered version, served in a
        # fresh process) is what this test checks, whichever alias the gate gives it
        "register": {"require_gain": False},
    }
    root = make_workspace(project_root, tmp_path / "ws", "tiny", overrides=over)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pipeline"]["tasks"] = {"rotten": {"corpus": "rotten_tomatoes"}, "bbc": {"corpus": "bbc_news"}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for k, task in enumerate(LABELS):
        (root / "data" / task).mkdir(parents=True)
        for name, df in tables(task, k).items():
            df.to_parquet(root / "data" / task / f"{name}.parquet", index=False)

    execute("model", None, root)
    manifest = json.loads((root / "models" / "base" / "manifest.json").read_text())
    for task in LABELS:
        execute("embed", task, root)  # the frozen-base probe of evaluate's comparisons reads its embeddings
        execute("finetune", task, root)
        config = json.loads((root / "data" / task / "finetune" / "config.json").read_text())
        assert config["base_model_hash"] == manifest["hash"]
        assert config["pooling"] == ("last" if family in DECODERS else "mean")
    for stage in ("merge", "quantize", "moe_build", "moe_quantize", "evaluate", "register"):
        execute(stage, None, root)
    qconfig = json.loads((root / "models" / "quantize" / "config.json").read_text())
    assert qconfig["rank_budget"] == 8 * json.loads((root / "metrics" / "quantize.json").read_text())["matrices"]
    registered = json.loads((root / "metrics" / "registered.json").read_text())
    alias = registered["aliases"][0]  # champion, or challenger where the gate's intervals refuse it

    # the registered version, from the registry alone, in a fresh process (the base model's folder gone)
    folder.rename(tmp_path / "moved")
    code = (
        "import json, mlflow.pyfunc, pandas as pd\n"
        f"m = mlflow.pyfunc.load_model('models:/crucible-classifier@{alias}')\n"
        "out = m.predict(pd.DataFrame({'text': ['the film was good great win', 'market price goal'], "
        "'task': ['rotten', 'bbc']}))\n"
        "print(json.dumps(out['label'].tolist()))\n"
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = json.loads(proc.stdout.strip().splitlines()[-1])
    assert labels[0] in LABELS["rotten"] and labels[1] in LABELS["bbc"]
