"""A stage sees only the params it declares.

`declared_view(params, keys, stage)` wraps the typed params so that reading a key outside `keys`
(and outside every declared section) raises `UndeclaredParam`, naming the key and the
declaration to add it to. A stage's declared params are its DVC params dependencies and what its
MLflow run logs, so a read that is not declared would be a change DVC cannot see: it stops the
stage instead. Reads go through unchanged otherwise: sections are views, leaves are the values.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel


class UndeclaredParam(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _covered(path: str, keys: tuple[str, ...]) -> bool:
    """`path` is a declared key or lies inside one."""
    return any(path == k or path.startswith(k + ".") for k in keys)


class _View:
    __slots__ = ("_obj", "_path", "_keys", "_stage")

    def __init__(self, obj, path: str, keys: tuple[str, ...], stage: str) -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_stage", stage)

    def _child(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _refuse(self, path: str):
        raise UndeclaredParam(
            f"stage {self._stage!r} read param '{path}', which its declaration does not list "
            f"(tasks/stages/{self._stage}.py, SPEC.params: {', '.join(self._keys) or 'none'}); declare it, "
            f"so that DVC reruns the stage when it changes and its MLflow run logs it"
        )

    def _wrap(self, path: str, value):
        if _covered(path, self._keys):
            return value
        if isinstance(value, (BaseModel, dict)):  # refused at the key read inside it, which names it
            return _View(value, path, self._keys, self._stage)
        self._refuse(path)

    def __getattr__(self, name: str):
        obj = self._obj
        if isinstance(obj, BaseModel) and name in type(obj).model_fields:
            return self._wrap(self._child(name), getattr(obj, name))
        attr = getattr(type(obj), name, None)
        raw = type(obj).__dict__.get(name)
        if isinstance(raw, (classmethod, staticmethod)):
            return attr  # reads no instance
        if callable(raw) and not name.startswith("model_"):
            # a helper method of the params (merge_order, task_sizes): its reads go through the view
            return functools.partial(attr, self)
        # anything else reads the whole object (model_dump, iteration helpers): the whole of it must
        # be declared
        if not _covered(self._path, self._keys):
            self._refuse(self._path or "(all params)")
        return getattr(obj, name)

    def __setattr__(self, name: str, value) -> None:
        raise TypeError("params are read-only")

    # mappings (pipeline.tasks, merge.methods, register.floors)
    def __getitem__(self, key):
        return self._wrap(self._child(str(key)), self._obj[key])

    def get(self, key, default=None):
        return self[key] if key in self._obj else default

    def __contains__(self, key) -> bool:
        return key in self._obj

    def _whole(self):
        if not _covered(self._path, self._keys):
            self._refuse(self._path)
        return self._obj

    def __iter__(self):
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())

    def keys(self):
        return self._whole().keys()

    def items(self):
        return self._whole().items()

    def values(self):
        return self._whole().values()

    def __repr__(self) -> str:
        return f"<params view {self._path or '(root)'} of stage {self._stage}>"


def declared_view(params: BaseModel, keys: tuple[str, ...], stage: str) -> Any:
    """`params` as the stage may read them: only `keys` (dotted; a section covers what is inside)."""
    return _View(params, "", tuple(keys), stage)


def declared_values(params: BaseModel, keys: tuple[str, ...]) -> dict[str, Any]:
    """{key: value} of each declared key (sections as plain mappings), for the stage's MLflow run."""
    out = {}
    for key in keys:
        value: Any = params
        for part in key.split("."):
            value = value[part] if isinstance(value, dict) else getattr(value, part)
        out[key] = value.model_dump() if isinstance(value, BaseModel) else value
    return out
