"""The safetensors file layout, written from the tensors' own memory.

``safetensors.torch.save`` copies every tensor into one ``bytes`` while it holds the GIL
(about 0.5 s per GiB), which stalls the event loop of a process writing a large checkpoint,
and costs a small model's federated round more than the rest of its encoding.  The layout
is simple: an 8-byte little-endian header length, a JSON header padded with spaces to 8
bytes, then each tensor's little-endian bytes back to back.  :func:`safetensors_parts` gives
it as parts (the tensors' bytes as views, no copy) for the checkpoint writer and the
federated wire; safetensors' own parser reads what they write.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from typing import Any, Final

import torch

__all__ = ["SAFETENSORS_DTYPES", "safetensors_parts"]

SAFETENSORS_DTYPES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""The dtypes written here (safetensors' names for them); others go through safetensors."""

_HEADER_LENGTH = struct.Struct("<Q")


def safetensors_parts(tensors: Mapping[str, torch.Tensor]) -> list[bytes | memoryview] | None:
    """The safetensors layout of contiguous CPU ``tensors``, in their order, as parts to write.

    ``None`` when a dtype is not in :data:`SAFETENSORS_DTYPES` or the machine is big-endian:
    use ``safetensors.torch.save`` then.  Views of one storage (tied weights) are written as
    separate tensors.
    """
    if sys.byteorder != "little" or any(t.dtype not in SAFETENSORS_DTYPES for t in tensors.values()):
        return None
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        chunk = memoryview(tensor.reshape(-1).view(torch.uint8).numpy().data)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + chunk.nbytes],
        }
        chunks.append(chunk)
        offset += chunk.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return [_HEADER_LENGTH.pack(len(text)), text, *chunks]
