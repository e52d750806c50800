import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the shared helpers (tests/support) import as `support.<module>` from every test folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
BIN = Path(sys.executable).parent

# the same process defaults the `crucible` command applies (tasks/runtime/env.py); tests never phone home
from tasks.runtime.env import apply_defaults  # noqa: E402

apply_defaults()
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


@pytest.fixture
def tiny_project(tmp_path_factory) -> Path:
    """A fresh scratch project (own git + DVC repo) with the tiny profile."""
    from tasks.runtime.workspace import make_workspace

    dest = tmp_path_factory.mktemp("proj")
    make_workspace(ROOT, dest, "tiny")
    os.environ.setdefault("PREFECT_HOME", str(dest / ".prefect"))
    return dest


@pytest.fixture
def tiny_params():
    from tasks.runtime.params import load_params

    return load_params(ROOT / "params.yaml", "tiny")


@pytest.fixture(scope="session")
def base_state():
    """The packaged base encoder's state dict (the merge and quantize stage tests start from it)."""
    from crucible.embed import load_encoder
    from tasks.data.models import resolve_model

    encoder, _ = load_encoder(resolve_model("all-MiniLM-L6-v2"))
    return {k: v.detach().clone().contiguous() for k, v in encoder.state_dict().items()}
