"""Writing a ``.safetensors`` file of f32 tensors straight into a given path.

The library's own writer fills a hidden temporary file of its own naming beside the target and
renames it at the end: an export killed on the way (``kill -9``, the out-of-memory killer) left
one as large as the export under a name nothing could tell from someone else's file. Written
here, the bytes go into the export's own staging file (whose leftovers ``yeto checkpoint
export`` recognizes and removes), tensor by tensor from the checkpoint's memory map.

The format: an 8-byte little-endian header length, a UTF-8 JSON header (padded with spaces to a
multiple of 8 bytes) mapping each name to its dtype, shape and ``[begin, end)`` byte range in
the data that follows, plus string ``__metadata__``; then the tensors' bytes, back to back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

#: The header's reserved key: string metadata, never a tensor's name.
METADATA_KEY = "__metadata__"
_HEADER_ALIGN = 8


def write_safetensors(
    path: Path, tensors: Mapping[str, NDArray[np.float32]], metadata: Mapping[str, str]
) -> None:
    """Write ``tensors`` (f32, in this order) and ``metadata`` to ``path`` as safetensors."""
    if METADATA_KEY in tensors:
        raise ValueError(f"a tensor may not be named {METADATA_KEY}")
    header: dict[str, object] = {METADATA_KEY: dict(metadata)}
    arrays = []
    offset = 0
    for name, tensor in tensors.items():
        # A view when it is one already; ascontiguousarray makes a 0-d tensor 1-d.
        array = np.ascontiguousarray(tensor, dtype="<f4").reshape(np.shape(tensor))
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGN)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for array in arrays:
            file.write(array.data.cast("B"))
