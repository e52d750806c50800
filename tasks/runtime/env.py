"""Process defaults that keep every tool's state inside the project and every phone-home off.

Applied (setdefault: a user's own setting wins) by the `crucible` command before prefect, mlflow
or dvc are imported, and by the tests (tests/conftest.py). The one place these values are written:
`make` targets run the `crucible` command or pytest, which apply them.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # the local ephemeral API server can take longer than Prefect's 20 s to start on a busy
    # 2-core machine; a slow start is not a failure
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
    # a tracking server that does not answer fails a run in under 30 s, not after MLflow's
    # default 7 retries with doubling backoff (about 4 minutes): 3 tries of at most 8 s each
    # (connect or read), 2 s apart. Set them in the environment to allow a slower server.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "8",
}


def apply_defaults(root: Path | None = None) -> None:
    """DEFAULTS, and Prefect's state under the project (`root`/.prefect) when a root is given."""
    if root is not None:
        os.environ.setdefault("PREFECT_HOME", str(Path(root).resolve() / ".prefect"))
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


if __name__ == "__main__":  # `python -m tasks.runtime.env CMD ARGS...`: CMD with the defaults (the Makefile's dvc)
    import sys

    apply_defaults(Path.cwd())
    os.execvp(sys.argv[1], sys.argv[1:])
