"""safetensors files: bytes that are the same for the same tensors and metadata, and the one
checked reader.

safetensors keeps the metadata in a hash map whose iteration order is random per process, so the
same tensors with two or more metadata keys can be written with differently ordered headers (and
a different md5: DVC sees a changed output, a reproducibility check fails). `safetensors_bytes`
writes with safetensors, then re-serialises the JSON header with sorted keys; the tensor data
section is already in a fixed order and its offsets are relative to the end of the header, so it
is kept byte for byte.

`read_safetensors` reads a file and checks it: it exists, it is not truncated or corrupt, its
tensors have the expected names and shapes, and every floating tensor is finite. Each error names
the file, the tensor and the value at fault, and says how to rebuild the file. It lives here, not
in tasks/, because the logged MLflow model (tasks/registry/pyfunc.py) carries crucible's code only;
the stages import it as tasks.runtime.io.read_safetensors.

`state_digest` names a state dict by its content (sha256 over names, dtypes, shapes and bytes), so
a caller can tell two state dicts that hold the same weights without keeping both.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Mapping, Sequence

# expected tensors: {name: shape} (None in a shape: any size), or a callable (tensors, metadata)
# -> None when they fit, else the problem as text (naming the tensor and the value)
Shapes = Mapping[str, Sequence[int | None]] | Callable[[dict, dict], str | None]


def canonical_header(data: bytes) -> bytes:
    """`data` (a safetensors file's bytes) with its JSON header keys sorted, padded to 8 bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors.torch.save with a canonical (sorted) header: deterministic bytes. Tensors on
    another device are copied to the CPU first (a file holds the same bytes whatever made it)."""
    from safetensors.torch import save

    tensors = {k: v if v.device.type == "cpu" else v.detach().cpu() for k, v in tensors.items()}
    return canonical_header(save(tensors, metadata=metadata))


def state_digest(tensors: Mapping) -> str:
    """sha256 (hex) of a state dict: every tensor's name, dtype, shape and bytes, in sorted name order.
    Equal for two dicts that load into a model as the same weights (whatever their key order, device
    or memory layout); different as soon as one name, dtype, shape or byte differs (so -0.0 and 0.0
    differ: a caller that treats equal digests as equal weights is never wrong, only sometimes
    cautious). About 1 GB/s on one core."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def read_safetensors(
    path: Path | str, what: str = "", rebuild: str = "", *, shapes: Shapes | None = None, finite: bool = True
) -> tuple[dict, dict[str, str]]:
    """(tensors, metadata) of the safetensors file `path`, checked.

    what: what the file holds, for the messages ("task heads"); rebuild: the command that remakes
    it, appended to every message; shapes: the expected tensors, {name: shape} (exactly these
    names; None in a shape matches any size) or a callable (tensors, metadata) -> problem or None;
    finite: every floating tensor must hold no NaN or inf.

    FileNotFoundError for a missing file; ValueError naming the file for a truncated or corrupt one
    (and the first tensor whose bytes lie past the end), a missing, unexpected or wrongly shaped
    tensor (its name, its shape and the expected one), or a non-finite value (the tensor, how many,
    the first one and where)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    tail = f"; {rebuild}" if rebuild else ""
    of = f" of the {what}" if what else ""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what or 'safetensors file'} not found{tail}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{path}: {what + ' is ' if what else ''}not a readable safetensors file"
            f"{_truncation(path) or ', truncated or corrupt'} ({exc}){tail}"
        ) from None
    if shapes is not None:
        problem = shapes(tensors, meta) if callable(shapes) else shape_problem(tensors, shapes, of)
        if problem:
            raise ValueError(f"{path}: {problem}{tail}")
    if finite:
        for name, t in tensors.items():
            problem = nonfinite(t)
            if problem:
                raise ValueError(f"{path}: tensor {name!r}{of} has {problem}{tail}")
    return tensors, meta


def _shape_text(shape) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def shape_problem(tensors: dict, expected: Mapping[str, Sequence[int | None]], of: str = "") -> str | None:
    """The first way `tensors` differ from `expected` ({name: shape}, None: any size), as text; None
    when they fit."""
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return (
            f"tensor {missing[0]!r}{of} is missing{more}; expected shape {_shape_text(expected[missing[0]])}, "
            f"the file holds {len(tensors)} tensors"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
            return f"tensor {name!r}{of} has shape {list(got)}, expected {_shape_text(shape)}"
    extra = sorted(set(tensors) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return (
            f"unexpected tensor {extra[0]!r}{of} of shape {list(tensors[extra[0]].shape)}{more}; "
            f"expected only {sorted(expected)[:5]}{' ...' if len(expected) > 5 else ''}"
        )
    return None


def nonfinite(t) -> str | None:
    """'<k> NaN or inf values of <n> (first: <value> at [i, j])' for a floating tensor holding
    any, else None."""
    import math

    import torch

    if not t.is_floating_point() or t.numel() == 0:
        return None
    # one reduction, no mask, for the usual all-finite tensor: min and max propagate NaN and an inf is
    # one of them (a mask per tensor made reading a model-sized file several times slower)
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # aminmax's dtypes
        lo, hi = torch.aminmax(t.detach())
        if math.isfinite(float(lo)) and math.isfinite(float(hi)):
            return None
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    index, rest = [], flat
    for size in reversed(t.shape):
        index.insert(0, rest % size)
        rest //= size
    return f"{int(bad.sum())} NaN or inf values of {t.numel()} (first: {t.reshape(-1)[flat].item()} at {index})"


def _truncation(path: Path) -> str:
    """', truncated: tensor X needs data bytes up to b, the file holds a' when the header says so,
    else ''."""
    try:
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    except Exception:  # noqa: BLE001 - only a diagnosis; the caller raises anyway
        return ""
    have = len(data) - 8 - n
    entries = sorted(((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__"))
    for end, name in entries:
        if end > have:
            return f", truncated: tensor '{name}' needs data bytes up to {end}, the file holds {max(have, 0)}"
    return ""
