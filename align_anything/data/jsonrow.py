"""Records and a row's pass-through keys stored as JSON text in one Arrow column.

A record's shape varies with its format and its file (message lists, extra columns of any
type, media given as paths or as embedded bytes), so the Arrow pipeline keeps each one as one
JSON string rather than asking Arrow to agree on a schema across batches and worker processes.
Bytes (embedded images) round-trip as ``{"__bytes__": base64}``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

_BYTES = "__bytes__"


def _default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"cannot store a {type(value).__name__} in a data row")


def _hook(obj: dict) -> Any:
    if len(obj) == 1 and _BYTES in obj:
        return base64.b64decode(obj[_BYTES])
    return obj


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=_default)


def loads(text: str) -> Any:
    return json.loads(text, object_hook=_hook)
