"""The logged model's pip requirements name the MLflow distribution that is installed: `mlflow`, or
`mlflow-skinny` on a serving install without the UI."""

from importlib import metadata

import pytest

from tasks.registry import pyfunc


def _installed(present: dict[str, str]):
    real = metadata.version

    def version(name):
        if name in ("mlflow", "mlflow-skinny"):
            if name not in present:
                raise metadata.PackageNotFoundError(name)
            return present[name]
        return real(name)

    return version


def test_skinny_alone_is_named_in_the_requirements(monkeypatch):
    monkeypatch.setattr(pyfunc.metadata, "version", _installed({"mlflow-skinny": "3.1.0"}))
    reqs = pyfunc.pip_requirements()
    assert "mlflow-skinny==3.1.0" in reqs
    assert not any(r.startswith("mlflow==") for r in reqs)


def test_full_mlflow_is_preferred_when_installed(monkeypatch):
    monkeypatch.setattr(pyfunc.metadata, "version", _installed({"mlflow": "3.1.0", "mlflow-skinny": "3.1.0"}))
    assert "mlflow==3.1.0" in pyfunc.pip_requirements()


def test_no_mlflow_at_all_says_what_to_install(monkeypatch):
    monkeypatch.setattr(pyfunc.metadata, "version", _installed({}))
    with pytest.raises(RuntimeError, match="pip install mlflow-skinny"):
        pyfunc.pip_requirements()
