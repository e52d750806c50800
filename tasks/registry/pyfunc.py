"""Models as MLflow pyfuncs: a DataFrame of texts in, labels and class probabilities out.

Two models live here:

- `MultiTaskClassifier`, the deployable model that the register stage logs and registers: one
  shared encoder (the packed MXFP4 one from models/quantize/, or the float merged one from
  models/merge/) with every task's head. It answers every task:

      model = mlflow.pyfunc.load_model("models:/crucible-classifier@champion")
      model.predict(pd.DataFrame({"text": ["Shares fell 3%", "a dull film"], "task": ["bbc", "rotten"]}))
      #    task     label  proba_business  proba_sport  proba_tech  proba_fresh  proba_rotten
      # 0   bbc  business            0.91         0.04        0.05         None          None
      # 1  rotten  rotten            None         None        None         0.12          0.88

  Output, one row per input row in the input's order: `task`, `label` (the argmax class of that
  row's task) and one `proba_<class>` column per class of every task (the union, in task order; a
  class name that two tasks share is one column). A row's probabilities of its own task's classes
  sum to 1; the cells of the other tasks' classes are None (JSON null over HTTP; `.astype(float)`
  makes them NaN), so the served JSON stays valid JSON.
  Bad input raises `MlflowException` with error code INVALID_PARAMETER_VALUE, which MLflow's
  scoring server answers with HTTP 400 and the message: no `text` or `task` column, an unknown task
  (the message lists the valid ones), an empty or non-string text (the message names the row).
  The model is logged "from code" (see below), so no pickle is written or read.

- `TextClassifier`, one fine-tuned task model (the finetune stage logs one per task):
  `predict(pd.DataFrame({"text": [...]}))` -> columns label, proba_<class>.

Both are logged "from code" the same way: `python_model=<this file>`, and the model's
`model_config` (`{"crucible_model": "<class name>"}`, kept in the MLmodel file) names the class
that the `set_model` call at the bottom registers when MLflow runs this file. No
`python_model.pkl` is written, and loading runs this file instead of unpickling anything; weights
and heads are safetensors, configs JSON.

Both are self-contained: the encoder's architecture and tokenizer files, the weights and heads
(safetensors), crucible's library code (`code_paths`) and pinned pip requirements travel with the
model, so it loads in a fresh process from the registry alone.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

MODEL_KINDS = ("quantized", "float")
CONFIG_NAME = "crucible.json"  # the multi-task model's own config inside its artifact folder
MODEL_CLASS_KEY = "crucible_model"  # the model_config key naming the class this file builds
# how to remake a logged model whose files are damaged (the messages of crucible.serialize.read_safetensors)
REBUILD = "log the model again (`crucible stage register`, or `crucible stage finetune` for a task model)"


class TextClassifier(mlflow.pyfunc.PythonModel):
    """crucible.train.EncoderClassifier behind MLflow's pyfunc interface."""

    def load_context(self, context) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from crucible.device import from_environment
        from crucible.models import build_from_config, prepare_tokenizer
        from crucible.serialize import read_safetensors
        from crucible.train import EncoderClassifier

        folder = Path(context.artifacts["model_dir"])
        self.config = json.loads((folder / "crucible_config.json").read_text())
        self.tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
        encoder = build_from_config(
            AutoConfig.from_pretrained(str(folder), local_files_only=True), self.config.get("dtype", "float32")
        )
        state, _ = read_safetensors(folder / "model.safetensors", "fine-tuned encoder", REBUILD)
        encoder.load_state_dict(state, strict=False)
        head, meta = read_safetensors(folder / "head.safetensors", "head", REBUILD)
        self.classes = json.loads(meta["classes"])
        self.model = EncoderClassifier(encoder, len(self.classes), pooling=self.config.get("pooling", "mean"))
        self.model.head.load_state_dict(head)
        self.device, self.autocast = from_environment()  # CRUCIBLE_DEVICE / CRUCIBLE_PRECISION, else auto
        self.model.to(self.device).eval()

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        import torch

        from crucible.train import predict, tokenize

        if isinstance(model_input, pd.Series):
            texts = model_input.astype(str).tolist()
        elif "text" in model_input.columns:
            texts = model_input["text"].astype(str).tolist()
        else:
            raise ValueError(f"expected a DataFrame with a 'text' column, got columns {list(model_input.columns)}")
        ids = tokenize(self.tokenizer, texts, self.config["max_length"])
        with torch.inference_mode():  # scoped: a global grad switch would leak into the caller's process
            logits = predict(self.model, ids, pad_id=self.tokenizer.pad_token_id or 0, autocast_dtype=self.autocast)
        proba = torch.softmax(logits, dim=1).numpy()
        out = pd.DataFrame({"label": [self.classes[i] for i in proba.argmax(1)]})
        for k, name in enumerate(self.classes):
            out[f"proba_{name}"] = proba[:, k]
        return out


# ---------------------------------------------------------------------------------------------------
# the deployable multi-task model


def _invalid(message: str) -> Exception:
    """The error for bad input: MLflow's scoring server answers it with HTTP 400 and `message`."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def proba_columns(classes: dict[str, list[str]], order: list[str]) -> list[str]:
    """The output's probability columns: proba_<class> over every task's classes, in task order,
    each name once."""
    out: list[str] = []
    for t in order:
        for c in classes[t]:
            if f"proba_{c}" not in out:
                out.append(f"proba_{c}")
    return out


def load_encoder_from(folder: Path, kind: str, dtype: str = "float32"):
    """(encoder, tokenizer) from a multi-task model's artifact folder: the architecture and tokenizer
    from folder/encoder/, the weights from folder/model.safetensors. `quantized`: the packed MXFP4
    file, by crucible.quant.load_quantized_encoder (the quantize stage's loader too; no float
    weights read), each matrix dequantized once (serving on the CPU: not once per request);
    `float`: a plain state dict with exactly the architecture's tensor names and shapes."""
    folder = Path(folder)
    if kind == "quantized":
        from crucible.quant import load_quantized_encoder

        return load_quantized_encoder(folder / "model.safetensors", folder / "encoder", dequantize_once=True)
    if kind != "float":
        raise ValueError(f"{folder / CONFIG_NAME}: field 'kind' = {kind!r}; expected one of {MODEL_KINDS}")
    from transformers import AutoConfig, AutoTokenizer

    from crucible.models import build_from_config, prepare_tokenizer
    from crucible.serialize import read_safetensors

    encoder = build_from_config(AutoConfig.from_pretrained(str(folder / "encoder"), local_files_only=True), dtype)
    state, _ = read_safetensors(
        folder / "model.safetensors",
        "merged encoder",
        REBUILD,
        shapes={k: tuple(v.shape) for k, v in encoder.state_dict().items()},
    )
    encoder.load_state_dict(state, strict=True)
    encoder.eval()
    return encoder, prepare_tokenizer(AutoTokenizer.from_pretrained(str(folder / "encoder"), local_files_only=True))


class MultiTaskClassifier(mlflow.pyfunc.PythonModel):
    """One encoder, one head per task: rows of (text, task) in, (task, label, proba_<class>...) out."""

    def load_context(self, context) -> None:
        self.load(Path(context.artifacts["model_dir"]))

    def load(self, folder: Path) -> "MultiTaskClassifier":
        import torch

        from crucible.device import from_environment
        from crucible.serialize import read_safetensors
        from crucible.train import EncoderClassifier

        folder = Path(folder)
        self.config = json.loads((folder / CONFIG_NAME).read_text())
        self.classes: dict[str, list[str]] = self.config["classes"]
        self.order: list[str] = [t for t in self.config.get("order") or self.classes if t in self.classes]
        self.max_length: dict[str, int] = {t: int(self.config["max_length"].get(t, 64)) for t in self.order}
        self.batch_size = int(self.config.get("batch_size", 64))
        self.columns = proba_columns(self.classes, self.order)
        self.encoder, self.tokenizer = load_encoder_from(
            folder, self.config["kind"], self.config.get("dtype", "float32")
        )
        # CRUCIBLE_DEVICE / CRUCIBLE_PRECISION, else auto: on CUDA the MXFP4 layers run the fused
        # Triton dequant-matmul; on a CPU each keeps its dequantized weight (bf16) between calls
        self.device, self.autocast = from_environment()
        self.encoder.to(self.device)
        self.pooling = self.config.get("pooling", "mean")
        heads, _ = read_safetensors(
            folder / "heads.safetensors",
            "task heads",
            REBUILD,
            shapes={
                f"{t}.{k}": shape
                for t, cls in self.classes.items()
                for k, shape in (("weight", (len(cls), None)), ("bias", (len(cls),)))
            },
        )
        self.models = {}
        for t in self.order:
            model = EncoderClassifier(self.encoder, len(self.classes[t]), dropout=0.0, pooling=self.pooling)
            with torch.no_grad():
                model.head.weight.copy_(heads[f"{t}.weight"])
                model.head.bias.copy_(heads[f"{t}.bias"])
            model.to(self.device).eval()
            self.models[t] = model
        return self

    def _valid_tasks(self) -> str:
        return ", ".join(self.order)

    def validate(self, model_input) -> pd.DataFrame:
        """The input as a DataFrame with string columns text and task; raises `_invalid` naming the
        problem (and the valid tasks, or the row)."""
        if isinstance(model_input, dict):
            try:
                model_input = pd.DataFrame(model_input)
            except ValueError as exc:
                raise _invalid(f"input: cannot make a table of {sorted(model_input)} ({exc})") from None
        if not isinstance(model_input, pd.DataFrame):
            raise _invalid(
                f"input must be a table with columns 'text' and 'task' (one of: {self._valid_tasks()}); "
                f"got {type(model_input).__name__}"
            )
        missing = [c for c in ("text", "task") if c not in model_input.columns]
        if missing:
            raise _invalid(
                f"input is missing column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}: "
                f"every row needs a 'text' and a 'task' (one of: {self._valid_tasks()}); "
                f"got columns {[str(c) for c in model_input.columns]}"
            )
        for i, (text, task) in enumerate(zip(model_input["text"], model_input["task"])):
            if not isinstance(task, str) or task not in self.models:
                raise _invalid(f"row {i}: unknown task {task!r}; valid tasks: {self._valid_tasks()}")
            if text is None or text is pd.NA or (isinstance(text, float) and text != text):
                raise _invalid(f"row {i}: column 'text' is missing (null)")
            if not isinstance(text, str):
                raise _invalid(f"row {i}: column 'text' must be a string, got {type(text).__name__} {text!r}")
            if not text.strip():
                raise _invalid(f"row {i}: column 'text' is empty")
        return model_input

    # model_input: pd.DataFrame, as TextClassifier's: what MLflow hands over under the signature, and a
    # hint that MLflow takes as "no type-hint validation"; without a hint MLflow warns, on every
    # import of this file (log_model, load_model), "Add type hints to the `predict` method"
    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        import numpy as np
        import torch

        from crucible.train import predict, tokenize

        df = self.validate(model_input)
        n = len(df)
        tasks = df["task"].tolist()
        texts = df["text"].tolist()
        labels: list[str | None] = [None] * n
        cells = {c: [None] * n for c in self.columns}
        pad = self.tokenizer.pad_token_id or 0
        for t in self.order:
            rows = [i for i in range(n) if tasks[i] == t]
            if not rows:
                continue
            ids = tokenize(self.tokenizer, [texts[i] for i in rows], self.max_length[t])
            with torch.inference_mode():  # scoped: a global grad switch would leak into the caller's process
                logits = predict(self.models[t], ids, self.batch_size, pad, self.autocast)
            proba = torch.softmax(logits.double(), dim=1).numpy()
            best = proba.argmax(1)
            for k, c in enumerate(self.classes[t]):
                column = cells[f"proba_{c}"]
                for j, i in enumerate(rows):
                    column[i] = float(proba[j, k])
            for j, i in enumerate(rows):
                labels[i] = self.classes[t][int(best[j])]
        out = pd.DataFrame({"task": pd.Series(tasks, dtype=object), "label": pd.Series(labels, dtype=object)})
        for c in self.columns:
            out[c] = pd.Series(cells[c], dtype=object)
        out.index = df.index if len(df.index) == n else np.arange(n)
        return out


def pip_requirements() -> list[str]:
    """What the logged model needs, pinned to the versions installed here. MLflow is whichever
    distribution provides it: `mlflow`, or `mlflow-skinny` on a serving install without the UI
    (both install the `mlflow` package; asking only for `mlflow` failed under skinny)."""
    names = ("torch", "transformers", "safetensors", "tokenizers", "pandas", "numpy", _mlflow_distribution(), "tqdm")
    return [f"{n}=={metadata.version(n).split('+')[0]}" for n in names]


def _mlflow_distribution() -> str:
    for name in ("mlflow", "mlflow-skinny"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError("neither mlflow nor mlflow-skinny is installed: pip install mlflow-skinny")


def _copy_library(dest: Path) -> Path:
    """crucible's library code (no caches) as dest/crucible, for `code_paths`."""
    import crucible

    target = Path(dest) / "crucible"
    shutil.copytree(Path(crucible.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def save_architecture(folder: Path, base_model_dir: str, tokenizer=None, config=None) -> Path:
    """The base model's tokenizer (save_pretrained: whatever files its type needs, e.g. DeBERTa's
    spm.model or a slow RoBERTa's vocab.json and merges.txt, with the pad token crucible set) and its
    config (config.json) into `folder`: what rebuilds the architecture offline."""
    from transformers import AutoConfig, AutoTokenizer

    from crucible.models import prepare_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True))
    if config is None:
        config = AutoConfig.from_pretrained(str(base_model_dir), local_files_only=True)
    tokenizer.save_pretrained(str(folder))
    config.save_pretrained(str(folder))
    return folder


def stage_multitask_folder(dest: Path, source: Path, kind: str, base_model_dir: str, extra: dict | None = None) -> Path:
    """The multi-task model's artifact folder `dest` (must not exist): encoder/ (architecture and
    tokenizer files of the base model), model.safetensors and heads.safetensors copied from the
    stage folder `source` (models/quantize/ or models/merge/), crucible.json (kind, classes,
    max_length, order, base_model, the source's config, and `extra`)."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r}; expected one of {MODEL_KINDS}")
    source, dest = Path(source), Path(dest)
    src_config = json.loads((source / "config.json").read_text())
    dest.mkdir(parents=True)
    save_architecture(dest / "encoder", base_model_dir)
    shutil.copy2(source / "model.safetensors", dest / "model.safetensors")
    shutil.copy2(source / "heads.safetensors", dest / "heads.safetensors")
    config = {
        "kind": kind,
        "base_model": src_config.get("base_model"),
        "classes": src_config["classes"],
        "max_length": src_config.get("max_length") or {},
        "order": src_config.get("order") or list(src_config["classes"]),
        "pooling": src_config.get("pooling", "mean"),
        "dtype": src_config.get("dtype", "float32"),
        "base_model_hash": src_config.get("base_model_hash"),
        "source_config": src_config,
        **(extra or {}),
    }
    (dest / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dest


def multitask_signature(classes: dict[str, list[str]], order: list[str]):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    # not `required` in the schema: a missing column then reaches `validate`, whose message names
    # the valid tasks, instead of MLflow's generic one
    inputs = Schema([ColSpec("string", "text", required=False), ColSpec("string", "task", required=False)])
    outputs = Schema(
        [
            ColSpec("string", "task"),
            ColSpec("string", "label"),
            *[ColSpec("double", c, required=False) for c in proba_columns(classes, order)],
        ]
    )
    return ModelSignature(inputs=inputs, outputs=outputs)


def save_multitask_model(
    dest: Path,
    source: Path,
    kind: str,
    base_model_dir: str,
    example: pd.DataFrame,
    extra: dict | None = None,
    mlflow_model=None,
) -> Path:
    """Write the deployable multi-task pyfunc to `dest` (a folder that must not exist), from a stage
    folder (`source`: models/quantize/ with kind 'quantized', models/merge/ with kind 'float').
    `example`: a few (text, task) rows, the model's input example; `mlflow_model`: the
    mlflow.models.Model to fill in (a logged model's ids), if any."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = stage_multitask_folder(Path(tmp) / "model_dir", source, kind, base_model_dir, extra)
        config = json.loads((folder / CONFIG_NAME).read_text())
        library = _copy_library(Path(tmp) / "code")
        mlflow.pyfunc.save_model(
            path=str(dest),
            python_model=str(Path(__file__).resolve()),
            artifacts={"model_dir": str(folder)},
            model_config={MODEL_CLASS_KEY: MultiTaskClassifier.__name__},
            code_paths=[str(library)],
            pip_requirements=pip_requirements(),
            mlflow_model=mlflow_model,
            signature=multitask_signature(config["classes"], config["order"]),
            input_example=example[["text", "task"]].reset_index(drop=True),
        )
    return dest


def save_text_classifier(
    dest: Path, finetune_dir: Path, base_model_dir: str, example: pd.DataFrame, *, tokenizer=None, config=None
) -> Path:
    """Write one task's fine-tuned pyfunc (a `TextClassifier`) to `dest` (a folder that must not
    exist), from the finetune stage's folder (model.safetensors, head.safetensors, config.json).
    Logged from code like the multi-task model: no pickle."""
    from mlflow.models import infer_signature

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_architecture(Path(tmp) / "model_dir", base_model_dir, tokenizer, config)
        shutil.copy2(finetune_dir / "model.safetensors", folder / "model.safetensors")
        shutil.copy2(finetune_dir / "head.safetensors", folder / "head.safetensors")
        shutil.copy2(finetune_dir / "config.json", folder / "crucible_config.json")
        library = _copy_library(Path(tmp) / "code")
        mlflow.pyfunc.save_model(
            path=str(dest),
            python_model=str(Path(__file__).resolve()),
            artifacts={"model_dir": str(folder)},
            model_config={MODEL_CLASS_KEY: TextClassifier.__name__},
            code_paths=[str(library)],
            pip_requirements=pip_requirements(),
            signature=infer_signature(example[["text"]], pd.DataFrame({"label": ["x"]})),
            input_example=example[["text"]].head(2),
        )
    return dest


def logged_model() -> mlflow.pyfunc.PythonModel:
    """The model this file builds when MLflow runs it as a logged model's code: an instance of the
    class that the model's `model_config` names under MODEL_CLASS_KEY (set by the save_* functions
    above). Without that key (a multi-task model logged before it existed) the multi-task model."""
    from mlflow.models import ModelConfig

    try:
        config = ModelConfig().to_dict() or {}
    except FileNotFoundError:  # the model was logged without a model_config
        config = {}
    name = config.get(MODEL_CLASS_KEY, MultiTaskClassifier.__name__)
    classes = {c.__name__: c for c in (MultiTaskClassifier, TextClassifier)}
    if name not in classes:
        raise ValueError(f"model_config {MODEL_CLASS_KEY!r} = {name!r}; expected one of {sorted(classes)}")
    return classes[name]()


if __name__ not in ("tasks.registry.pyfunc", "__main__"):
    # MLflow runs this file as a logged model's code ("models from code", python_model=<this
    # file>): the model is this object, its weights come from the logged artifacts.
    mlflow.models.set_model(logged_model())
