"""params.yaml: one typed schema, one section per stage, validated on load.

Unknown keys, wrong types and out-of-range values stop with `ParamsError`, whose message names the
file, the key, the value and what is allowed. Stage code takes its params from `load_params`, never
from globals.

    crucible params check [FILE]           # validate a file
    crucible params render --profile tiny  # params.yaml with a profile's overrides applied
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.runtime.params_schema import CORPORA, Params

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


class ParamsError(ValueError):
    """params.yaml (or a profile) is invalid. The message says where and what is allowed."""


# ---------------------------------------------------------------------------------------------------
# loading and error messages


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed at `loc` (the location of an unknown key's parent), walking the schema."""
    current: Any = model
    skip_key = False  # the next part is a dict key (a task name), not a field
    for part in loc:
        if skip_key or isinstance(part, int):
            skip_key = False
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return []
        ann = current.model_fields[part].annotation
        if getattr(ann, "__origin__", None) is dict:
            current, skip_key = ann.__args__[1], True
        else:
            current = next(
                (a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)),
                None,
            )
    return sorted(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent, name = loc[:-1], str(loc[-1])
            allowed = _allowed_keys(Params, parent)
            hint = difflib.get_close_matches(name, allowed, n=1)
            msg = f"{source}: unknown key '{key}'"
            if hint:
                msg += f" (did you mean '{'.'.join(map(str, parent + (hint[0],)))}'?)"
            if allowed:
                under = f" under {'.'.join(map(str, parent))!r}" if parent else ""
                msg += f"; allowed keys{under}: {', '.join(allowed)}"
            lines.append(msg)
        elif e["type"] == "missing":
            lines.append(f"{source}: missing key '{key}': {e['msg']}")
        else:
            where = f"key '{key}'" if key else "top level"
            value = e.get("input")
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            lines.append(f"{source}: {where} = {shown}: {e['msg']}")
    return "\n".join(lines)


SCHEMA = "schema"  # `extends: schema`: a profile that starts from the schema's defaults, not from params.yaml


class _FromSchema(dict):
    """A profile's overrides whose chain starts at `extends: schema` (profiles/demo.yaml, and the
    profiles that extend it): rendered onto the schema's defaults; params.yaml is not read."""


def schema_defaults() -> dict:
    """Every key at the schema's default, and no tasks (pipeline.tasks has no default)."""
    data = Params.model_validate({"pipeline": {"tasks": {"task": {"corpus": CORPORA[0]}}}}).model_dump()
    data["pipeline"]["tasks"] = {}
    return data


class Override(dict):
    """A mapping a profile marks `!override`: it replaces the inherited mapping instead of merging
    into it (Docker Compose's tag for the same thing). `pipeline.tasks: !override {spam: {}}` runs
    only `spam`, whatever params.yaml or the extended profile lists."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (plain YAML keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # let the base class report an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping: at line {seen[key] + 1} and at "
                    f"line {key_node.start_mark.line + 1} (YAML would silently keep the last; keep one)",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _construct_override(loader: _UniqueKeyLoader, node: yaml.Node) -> Override:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(
            None, None, f"!override marks a mapping (key: !override {{...}}), not a {node.id}", node.start_mark
        )
    return Override(loader.construct_mapping(node, deep=True))


_UniqueKeyLoader.add_constructor("!override", _construct_override)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ParamsError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} on line {line}); save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at top level, got {type(data).__name__}")
    return data


def deep_merge(base: dict, override: dict) -> dict:
    """`override` applied onto `base`: mappings merge key by key, anything else replaces, and so
    does a mapping marked `!override` (which stays marked, so that it also replaces what the next
    file down the chain has)."""
    out = dict(base)
    for key, value in override.items():
        merge = isinstance(value, dict) and not isinstance(value, Override) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if merge else value
    # merged into a marked mapping (a profile extending one that replaces): still replaces further down;
    # a profile extending one that starts from the schema starts from it too
    return type(base)(out) if isinstance(base, (Override, _FromSchema)) else out


def _plain(data):
    """Marked mappings as plain ones (for validation and YAML output)."""
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_plain(v) for v in data]
    return data


def profile_path(profile: str) -> Path:
    path = Path(profile)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ParamsError(
            f"unknown profile {profile!r}; known profiles: {', '.join(known)} (or a path to a .yaml file)"
        )
    return path


def read_profile(profile: str, _seen: tuple[Path, ...] = ()) -> dict:
    """A profile's overrides. `extends: NAME` at its top builds on another profile (whose own
    overrides apply first); the chain may not loop. `extends: schema` builds on the schema's
    defaults instead of params.yaml (profiles/demo.yaml: the demo as shipped, whatever a project's
    own params.yaml says)."""
    path = profile_path(profile).resolve()
    if path in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path))
        raise ParamsError(f"{path}: profiles extend each other in a loop ({chain})")
    data = _read_yaml(path)
    base = data.pop("extends", None)
    if base is None:
        return data
    if base == SCHEMA:
        return _FromSchema(deep_merge(schema_defaults(), data))
    if not isinstance(base, str):
        raise ParamsError(f"{path}: 'extends' names one profile (a string), got {base!r}")
    return deep_merge(read_profile(base, (*_seen, path)), data)


def tasks_added(path: Path | str, profile: str) -> tuple[str, list[str], list[str]] | None:
    """(where the inherited tasks come from, the tasks the profile names, the inherited tasks) when
    `profile` gives `pipeline.tasks` as a plain mapping, which adds to the tasks it inherits (from
    params.yaml, or the profile it extends) instead of replacing them as `!override` does; None
    otherwise. A profile meant to run its own tasks then also runs the inherited ones."""
    data = _read_yaml(profile_path(profile))
    pipeline = data.get("pipeline")
    own = pipeline.get("tasks") if isinstance(pipeline, dict) else None
    if not isinstance(own, dict) or isinstance(own, Override):
        return None
    base = data.get("extends")
    if isinstance(base, str):
        inherited, where = render_params(path, base), f"profile {base}"
    else:
        inherited, where = _plain(_read_yaml(Path(path))), Path(path).name
    tasks = (inherited.get("pipeline") or {}).get("tasks") or {}
    extra = [t for t in tasks if t not in own]
    return (where, [t for t, v in own.items() if v is not None], extra) if extra else None


def render_params(path: Path | str = "params.yaml", profile: str | None = None) -> dict:
    """The raw params mapping of `path`, with the profile's overrides merged on top (a profile that
    starts from the schema, `extends: schema` at the root of its chain, does not read `path`)."""
    overrides = read_profile(profile) if profile else None
    if isinstance(overrides, _FromSchema):
        data = dict(overrides)
    else:
        data = _read_yaml(Path(path))
        if profile:
            data = deep_merge(data, overrides)
    if profile:
        if isinstance(data.get("pipeline"), dict) and "tasks" in data["pipeline"]:
            # `task: null` drops the task: DVC's foreach (which reads this file) must not see it either
            from tasks.runtime.params_schema import _drop_nulls

            data["pipeline"]["tasks"] = _drop_nulls(data["pipeline"]["tasks"])
    return _plain(data)


def validate_params(data: dict, source: str) -> Params:
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        raise ParamsError(format_validation_error(exc, source)) from None


def load_params(path: Path | str = "params.yaml", profile: str | None = None) -> Params:
    """Read and validate params (optionally with a profile applied). Raises ParamsError."""
    source = str(path) + (f" (+ profile {profile})" if profile else "")
    return validate_params(render_params(path, profile), source)
