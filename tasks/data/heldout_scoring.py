"""Scoring encoder weights on the tasks' test splits, each task with its own head: shared by the
merge stage (every merged model after every arrival) and the quantize stage (float vs MXFP4 vs
compensated). Reads a task's fine-tune (`read_task_model`); `Scorer` tokenises each test split once
and scores any weights, or any encoder module of the same architecture, on it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tasks.data.models import read_model_folder
from tasks.runtime.io import read_safetensors, read_stage_output, read_table, rebuild_hint


def read_task_model(root: Path, task: str, base_model: str, base_hash: str | None = None) -> dict:
    """A task's fine-tune: paths, head tensors, classes, max_length, pooling; checks it was made from
    base_model (and, given `base_hash`, from a base of that content: models/base/manifest.json's hash)
    and that its files are readable and finite (each error names the file and the command that
    rebuilds it)."""
    rebuild = rebuild_hint("finetune", task)
    paths, config = read_model_folder(
        root / "data" / task / "finetune",
        ("model.safetensors", "head.safetensors", "config.json"),
        base_model,
        base_hash,
        rebuild,
        "the merge stage needs every task's fine-tune",
    )
    read_safetensors(paths["model.safetensors"], f"fine-tuned encoder of task {task!r}", rebuild)
    what = f"head of task {task!r}"
    head, meta = read_safetensors(
        paths["head.safetensors"], what, rebuild, shapes=lambda t, m: _head_problem(t, m, what)
    )
    return {
        "task": task,
        "model": paths["model.safetensors"],
        "head": head,
        "classes": json.loads(meta["classes"]),
        "max_length": int(config.get("max_length", 64)),
        "pooling": config.get("pooling", "mean"),
    }


def _head_problem(tensors: dict, meta: dict, what: str) -> str | None:
    """A fine-tune's head file: metadata `classes` (a JSON list), tensors `weight` (n_classes,
    hidden) and `bias` (n_classes,)."""
    from crucible.serialize import shape_problem

    try:
        classes = json.loads(meta.get("classes", "null"))
    except json.JSONDecodeError:
        classes = None
    if not isinstance(classes, list):
        return f"metadata 'classes' = {meta.get('classes')!r}; expected a JSON list of the task's classes"
    return shape_problem(tensors, {"weight": (len(classes), None), "bias": (len(classes),)}, f" of the {what}")


class Scorer:
    """Each task's test split (and optionally its probe rows) tokenised once; any encoder weights, or
    any encoder module of the same architecture, scored on them with the task's own head, and their
    frozen features (pooled as in fine-tuning, what the head sees) kept for the evaluate stage.

    model: a BaseModel (tasks.data.models) or a model path (float32, mean pooling).
    probes: task -> DataFrame(text, label) of the rows a fresh probe is fitted on (evaluate).
    keep_theta_0: keep a copy of the base weights (`theta_0`; merge needs them, quantize does not:
    it holds one copy of the weights less)."""

    def __init__(
        self,
        model,
        tasks: list[dict],
        tests: dict[str, pd.DataFrame],
        batch_size: int,
        probes: dict[str, pd.DataFrame] | None = None,
        keep_theta_0: bool = True,
    ):
        import torch

        from crucible.embed import load_encoder
        from crucible.train import tokenize

        if isinstance(model, str):
            self.encoder, tokenizer = load_encoder(model)
            self.pooling = "mean"
        else:
            self.encoder, tokenizer = model.load()
            self.pooling = model.pooling(self.encoder.config)
        self.encoder.eval()
        self.tokenizer = tokenizer
        self.theta_0 = {k: v.detach().clone() for k, v in self.encoder.state_dict().items()} if keep_theta_0 else None
        self.pad_id = tokenizer.pad_token_id or 0
        self.batch_size = batch_size
        self.heads, self.classes, self.data, self.ids = {}, {}, {}, {}
        splits = {"test": tests, **({"probe": probes} if probes is not None else {})}
        for spec in tasks:
            t = spec["task"]
            self.heads[t] = (spec["head"]["weight"].float(), spec["head"]["bias"].float())
            self.classes[t] = list(spec["classes"])
            index = {c: i for i, c in enumerate(spec["classes"])}
            for split, frames in splits.items():
                df = frames[t]
                unknown = sorted(set(df["label"]) - set(index))
                if unknown:
                    source = "test.parquet" if split == "test" else "probe rows"
                    raise ValueError(
                        f"data/{t}/{source}: column 'label' has {unknown[:3]}, not among the head's "
                        f"classes {spec['classes']}"
                    )
                ids = tokenize(tokenizer, df["text"].tolist(), spec["max_length"])
                if "id" in df:
                    self.ids[t, split] = df["id"].tolist()
                self.data[t, split] = (ids, torch.tensor(df["label"].map(index).to_numpy(), dtype=torch.long))

    @property
    def tasks(self) -> list[str]:
        return list(self.heads)

    def load(self, state: dict) -> None:
        self.encoder.load_state_dict(state, strict=True)

    def use_encoder(self, encoder) -> None:
        """Score `encoder` (e.g. a quantized copy) from now on; `load` then loads into it."""
        self.encoder = encoder
        self.encoder.eval()

    def labels(self, task: str, split: str = "test"):
        """(n,) int64 class indices of the task's rows in `split`."""
        return self.data[task, split][1]

    def features(self, task: str, split: str = "test", limit: int | None = None):
        """(n, hidden) float32 pooled features of the current encoder on the split's rows (the first
        `limit` of them when given), in row order, on the CPU (the encoder runs on its device, under
        the run's autocast)."""
        import torch

        from crucible.models import encode
        from crucible.train import collate
        from tasks.runtime.device import current

        ids, _ = self.data[task, split]
        ids = ids[:limit] if limit else ids
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding per batch
        out = torch.empty(len(ids), self.encoder.config.hidden_size)
        with torch.inference_mode():
            for start in range(0, len(ids), self.batch_size):
                idx = order[start : start + self.batch_size]
                input_ids, mask = collate([ids[i] for i in idx], self.pad_id)
                with current().autocast():  # encode moves the batch to the encoder's device
                    out[torch.tensor(idx)] = encode(self.encoder, input_ids, mask, self.pooling).float().cpu()
        return out

    def head_logits(self, task: str, features):
        """(n, n_classes) logits of the task's head on `features` (on the features' device)."""
        import torch

        weight, bias = self.heads[task]
        return torch.nn.functional.linear(features, weight.to(features.device), bias.to(features.device))

    def logits(self, task: str):
        """(n_test, n_classes) logits of the current encoder with the task's head."""
        return self.head_logits(task, self.features(task))

    def accuracy(self, task: str, logits=None) -> float:
        """Test accuracy of the current encoder (or of precomputed `logits`, on the first len(logits)
        test rows) on the task."""
        logits = self.logits(task) if logits is None else logits
        return float((logits.argmax(1) == self.labels(task)[: len(logits)]).float().mean())


class FeatureStore:
    """Frozen features of model variants, for the evaluate stage: the stage that runs an encoder over
    the texts keeps what it computed, so no encoder runs twice over the same texts.

    Variants given as weights (`add(..., state=...)`) share work: the features of weights already
    scored (the same state_digest) on the same rows are copied, not encoded again, e.g. three merge
    methods whose first arrival is the same model. A copy holds the bytes an encode would give: the
    same weights, rows, batches and threads give the same features (the CPU path is deterministic).

    A variant is scored on every test row, or on the first `test_limit` (the continual matrices:
    every merge method after every arrival); features known on more rows are sliced, not encoded.

    On disk (safetensors): `<variant>/<task>/<split>` (n, hidden) float32 and `labels/<task>/<split>`
    (n,) int64 for all of the split's rows (a variant's test features may cover only the first rows);
    metadata `variants` (JSON list of {name, family, method, arrival, tasks, test_rows}), `classes`
    and `tasks`. Variant names: `base`, `finetune:<task>`, `<method>@<arrival>`, `quantize:<variant>`."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.tensors: dict[str, object] = {}
        self.variants: list[dict] = []
        self.known: dict[tuple[str, str, str], object] = {}  # (state digest, task, split) -> features
        self.encoded = self.copied = 0  # (task, split) feature sets computed / copied from a known state
        for (t, split), (_, labels) in scorer.data.items():
            self.tensors[f"labels/{t}/{split}"] = labels

    def add(
        self,
        name: str,
        family: str,
        method: str,
        arrival: int,
        tasks: list[str],
        state: dict | None = None,
        test_limit: int | None = None,
    ) -> dict[str, float]:
        """Features on `tasks` (test rows, the first `test_limit` of them when given, and probe rows
        if any) under variant `name`; returns the head's test accuracy per task on those rows. With
        `state`, of those weights: loaded into the scorer's encoder only when some of the features
        are not known yet. Without it, of the scorer's current encoder (e.g. a quantized copy),
        nothing shared. A variant added again under its name is replaced in place."""
        from crucible.serialize import state_digest

        digest = state_digest(state) if state is not None else None
        loaded = state is None
        acc, rows = {}, {}
        for t in tasks:
            for split in ("test", "probe"):
                if (t, split) not in self.scorer.data:
                    continue
                n_rows = len(self.scorer.data[t, split][0])
                limit = min(test_limit, n_rows) if (split == "test" and test_limit) else n_rows
                known = self.known.get((digest, t, split)) if digest else None
                if known is not None and len(known) >= limit:
                    features = known[:limit].clone()  # a file cannot hold two names for one memory
                    self.copied += 1
                else:
                    if not loaded:
                        self.scorer.load(state)
                        loaded = True
                    features = self.scorer.features(t, split, limit)
                    self.encoded += 1
                    if digest:
                        self.known[digest, t, split] = features
                self.tensors[f"{name}/{t}/{split}"] = features
            logits = self.scorer.head_logits(t, self.tensors[f"{name}/{t}/test"])
            acc[t] = self.scorer.accuracy(t, logits)
            rows[t] = len(logits)
        entry = {
            "name": name,
            "family": family,
            "method": method,
            "arrival": arrival,
            "tasks": list(tasks),
            "test_rows": rows,
        }
        known = [i for i, v in enumerate(self.variants) if v["name"] == name]
        if known:  # added again (e.g. on more test rows): replaced where it was
            self.variants[known[0]] = entry
        else:
            self.variants.append(entry)
        return acc

    def accuracy(self, name: str, task: str, limit: int | None = None) -> float:
        """Head accuracy of variant `name` on the task's first `limit` test rows (all it has when None)."""
        features = self.tensors[f"{name}/{task}/test"]
        return self.scorer.accuracy(task, self.scorer.head_logits(task, features[:limit] if limit else features))

    def to_bytes(self) -> bytes:
        from crucible.serialize import safetensors_bytes

        return safetensors_bytes(
            {k: v.contiguous() for k, v in self.tensors.items()},
            {
                "variants": json.dumps(self.variants),
                "classes": json.dumps(self.scorer.classes),
                "tasks": json.dumps(self.scorer.tasks),
            },
        )


def probe_ids(scorer: Scorer) -> dict[str, list]:
    """Per task the ids of the scorer's probe rows, in row order."""
    return {t: scorer.ids[t, "probe"] for t in scorer.tasks if (t, "probe") in scorer.ids}


def read_features(path: Path, stage: str) -> tuple[dict, dict]:
    """(tensors, metadata with `variants`, `classes`, `tasks` decoded) of a FeatureStore file; each
    error names the file and the stage that makes it."""
    tensors, meta = read_safetensors(
        path,
        "features",
        f"run the {stage} stage first (`crucible stage {stage}` or `dvc repro {stage}`)",
        shapes=_features_problem,
    )
    return tensors, {k: json.loads(meta[k]) for k in ("variants", "classes", "tasks")}


def _features_problem(tensors: dict, meta: dict) -> str | None:
    """A FeatureStore file: metadata variants, classes, tasks (JSON); every variant's features
    `<variant>/<task>/<split>` of its tasks, as many rows as `labels/<task>/<split>`."""
    try:
        decoded = {k: json.loads(meta[k]) for k in ("variants", "classes", "tasks")}
    except (KeyError, json.JSONDecodeError) as exc:
        return f"metadata lacks {exc}; expected variants, classes, tasks"
    for v in decoded["variants"]:
        for t in v["tasks"]:
            for split in ("test", "probe"):
                name, labels = f"{v['name']}/{t}/{split}", tensors.get(f"labels/{t}/{split}")
                if labels is None or name not in tensors:
                    if split == "test" or labels is not None:
                        return f"tensor {name!r} (or 'labels/{t}/{split}') of variant {v['name']!r} is missing"
                    continue
                rows = tensors[name].shape[0] if tensors[name].dim() == 2 else None
                expected = labels.shape[0]
                if split == "test":  # a variant scored on the first rows only (FeatureStore.add's test_limit)
                    expected = min(int((v.get("test_rows") or {}).get(t, expected)), expected)
                if rows != expected or rows == 0:
                    return (
                        f"tensor {name!r} has shape {list(tensors[name].shape)}, expected "
                        f"[{expected}, hidden] (the rows of 'labels/{t}/{split}')"
                    )
    return None


def read_tests(root: Path, params) -> dict[str, pd.DataFrame]:
    """Each task's clean test split, every row, in merge order."""
    return {t: read_table(Path(root) / "data" / t / "test.parquet", "test") for t in params.merge_order()}


def read_probe_rows(root: Path, params) -> dict[str, pd.DataFrame]:
    """Per task the rows (text, label) that evaluate's fresh probe is fitted on: the clean reference,
    or labeled.parquet (reference + audited members + selected pseudo-labels), per
    `evaluate.probe_rows`, the first `evaluate.probe_limit` of them."""
    cfg = params.evaluate
    out = {}
    for t in params.merge_order():
        if cfg.probe_rows == "reference":
            df = read_table(Path(root) / "data" / t / "reference.parquet", "reference")
        else:
            df = read_stage_output(
                Path(root) / "data" / t / "labeled.parquet", "labeled", ("text", "label"), "pseudolabel"
            )
        df = df[["id", "text", "label"]]
        out[t] = df.head(cfg.probe_limit) if cfg.probe_limit else df
    return out
