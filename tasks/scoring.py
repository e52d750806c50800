"""Scoring encoder weights on the tasks' test splits, each task with its own head: shared by the
merge stage (every merged model after every arrival) and the quantize stage (float vs MXFP4 vs
compensated). Reads a task's fine-tune (`read_task_model`); `Scorer` tokenises each test split once
and scores any weights, or any encoder module of the same architecture, on it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def read_task_model(root: Path, task: str, base_model: str) -> dict:
    """A task's fine-tune: paths, head tensors, classes, max_length; checks it was made from base_model."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = root / "data" / task / "finetune"
    paths = {name: folder / name for name in ("model.safetensors", "head.safetensors", "config.json")}
    for path in paths.values():
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; the merge stage needs every task's fine-tune "
                                    f"(run `crucible stage finetune --task {task}` or `dvc repro finetune@{task}`)")
    config = json.loads(paths["config.json"].read_text())
    if config.get("base_model") != base_model:
        raise ValueError(f"{paths['config.json']}: field 'base_model' = {config.get('base_model')!r}, but "
                         f"embed.model is {base_model!r}; every task model must be fine-tuned from the same base "
                         f"(rerun finetune@{task})")
    head = load_file(str(paths["head.safetensors"]))
    with safe_open(str(paths["head.safetensors"]), "pt") as f:
        classes = json.loads((f.metadata() or {}).get("classes", "null"))
    if set(head) != {"weight", "bias"} or classes is None or head["weight"].shape[0] != len(classes):
        raise ValueError(f"{paths['head.safetensors']}: expected tensors 'weight' (n_classes, hidden) and 'bias' "
                         f"and metadata 'classes'; got tensors {sorted(head)}, classes {classes}")
    return {"task": task, "model": paths["model.safetensors"], "head": head, "classes": classes,
            "max_length": int(config.get("max_length", 64))}


class Scorer:
    """Accuracy of encoder weights on each task's test split, with the task's own head."""

    def __init__(self, model_path: str, tasks: list[dict], tests: dict[str, pd.DataFrame], batch_size: int):
        import torch

        from crucible.embed import load_encoder
        from crucible.train import EncoderClassifier, tokenize

        self.encoder, tokenizer = load_encoder(model_path)
        self.tokenizer = tokenizer
        self.theta_0 = {k: v.detach().clone() for k, v in self.encoder.state_dict().items()}
        self.pad_id = tokenizer.pad_token_id or 0
        self.batch_size = batch_size
        self.models, self.data = {}, {}
        for spec in tasks:
            t = spec["task"]
            model = EncoderClassifier(self.encoder, len(spec["classes"]), dropout=0.0)
            with torch.no_grad():
                model.head.weight.copy_(spec["head"]["weight"])
                model.head.bias.copy_(spec["head"]["bias"])
            model.eval()
            index = {c: i for i, c in enumerate(spec["classes"])}
            test = tests[t]
            unknown = sorted(set(test["label"]) - set(index))
            if unknown:
                raise ValueError(f"data/{t}/test.parquet: column 'label' has {unknown[:3]}, not among the head's "
                                 f"classes {spec['classes']}")
            ids = tokenize(tokenizer, test["text"].tolist(), spec["max_length"])
            self.models[t] = model
            self.data[t] = (ids, torch.tensor(test["label"].map(index).to_numpy(), dtype=torch.long))

    def load(self, state: dict) -> None:
        self.encoder.load_state_dict(state, strict=True)

    def use_encoder(self, encoder) -> None:
        """Score `encoder` (e.g. a quantized copy) from now on; `load` then loads into it."""
        self.encoder = encoder
        for model in self.models.values():
            model.encoder = encoder

    def logits(self, task: str):
        """(n_test, n_classes) logits of the current encoder with the task's head."""
        from crucible.train import predict

        ids, _ = self.data[task]
        return predict(self.models[task], ids, self.batch_size, self.pad_id)

    def accuracy(self, task: str, logits=None) -> float:
        """Test accuracy of the current encoder (or of precomputed `logits`) on the task."""
        logits = self.logits(task) if logits is None else logits
        return float((logits.argmax(1) == self.data[task][1]).float().mean())
