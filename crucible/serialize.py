"""safetensors bytes that are the same for the same tensors and metadata.

safetensors keeps the metadata in a hash map whose iteration order is random per process, so the
same tensors with two or more metadata keys can be written with differently ordered headers (and
a different md5: DVC sees a changed output, a reproducibility check fails). `safetensors_bytes`
writes with safetensors, then re-serialises the JSON header with sorted keys; the tensor data
section is already in a fixed order and its offsets are relative to the end of the header, so it
is kept byte for byte.
"""

from __future__ import annotations

import json
import struct


def canonical_header(data: bytes) -> bytes:
    """`data` (a safetensors file's bytes) with its JSON header keys sorted, padded to 8 bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors.torch.save with a canonical (sorted) header: deterministic bytes."""
    from safetensors.torch import save

    return canonical_header(save(tensors, metadata=metadata))
