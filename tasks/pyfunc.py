"""A fine-tuned task model as an MLflow pyfunc: a DataFrame of texts in, labels and probabilities out.

    model = mlflow.pyfunc.load_model("runs:/<run_id>/model")      # or models:/<name>@champion
    model.predict(pd.DataFrame({"text": ["great film", "dull"]}))  # columns: label, proba_<class>...

The logged model is self-contained: the encoder's config and tokenizer files, the fine-tuned
weights and head (safetensors), crucible's library code, and explicit pip requirements.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


class TextClassifier(mlflow.pyfunc.PythonModel):
    """crucible.train.EncoderClassifier behind MLflow's pyfunc interface."""

    def load_context(self, context) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from crucible.train import EncoderClassifier

        folder = Path(context.artifacts["model_dir"])
        self.config = json.loads((folder / "crucible_config.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        encoder = AutoModel.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
        encoder.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
        with safe_open(str(folder / "head.safetensors"), framework="pt") as fh:
            self.classes = json.loads(fh.metadata()["classes"])
        self.model = EncoderClassifier(encoder, len(self.classes))
        self.model.head.load_state_dict(load_file(str(folder / "head.safetensors")))
        self.model.eval()

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
            logits = predict(self.model, ids, pad_id=self.tokenizer.pad_token_id or 0)
        proba = torch.softmax(logits, dim=1).numpy()
        out = pd.DataFrame({"label": [self.classes[i] for i in proba.argmax(1)]})
        for k, name in enumerate(self.classes):
            out[f"proba_{name}"] = proba[:, k]
        return out


def pip_requirements() -> list[str]:
    names = ("torch", "transformers", "safetensors", "tokenizers", "pandas", "numpy", "mlflow")
    return [f"{n}=={metadata.version(n).split('+')[0]}" for n in names]


def save_text_classifier(dest: Path, finetune_dir: Path, base_model_dir: str, example: pd.DataFrame) -> Path:
    """Write the pyfunc model to `dest` (a folder that must not exist)."""
    import crucible

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model_dir"
        folder.mkdir()
        for name in TOKENIZER_FILES:
            if (Path(base_model_dir) / name).exists():
                shutil.copy2(Path(base_model_dir) / name, folder / name)
        shutil.copy2(finetune_dir / "model.safetensors", folder / "model.safetensors")
        shutil.copy2(finetune_dir / "head.safetensors", folder / "head.safetensors")
        shutil.copy2(finetune_dir / "config.json", folder / "crucible_config.json")
        from mlflow.models import infer_signature

        python_model = TextClassifier()
        mlflow.pyfunc.save_model(
            path=str(dest), python_model=python_model, artifacts={"model_dir": str(folder)},
            code_paths=[str(Path(crucible.__file__).parent)], pip_requirements=pip_requirements(),
            signature=infer_signature(example[["text"]], pd.DataFrame({"label": ["x"]})),
            input_example=example[["text"]].head(2))
    return dest
