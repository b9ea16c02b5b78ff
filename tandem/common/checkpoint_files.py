"""The files of a HuggingFace checkpoint directory, found and read with errors that name
them.

Torch-free at import: the router reads the JSON files too (``open_safetensors``, for the
engine, loads ``safetensors`` and torch when called). Every problem is one ``ValueError``
whose message names the file: a required file that is missing, JSON that does not parse
or is not an object, a weight index that is unreadable or names a shard that is not
there, a shard that is not a safetensors file.

Weights: with a ``model.safetensors.index.json`` the weights are exactly the shards its
``weight_map`` names, as ``transformers`` and vLLM read them; any other ``*.safetensors``
beside it (a consolidated copy left next to the shards, an unrelated file) is ignored.
Without an index, every ``*.safetensors`` in the directory holds weights.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when an optional file is missing."""
    if not path.exists():
        if required:
            raise ValueError(f"model directory {path.parent} has no {path.name}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The files holding the checkpoint's weights, in a stable order (see the module
    docstring); a ``ValueError`` naming the file when there are none or the index is
    unusable."""
    root = Path(model_dir)
    index = root / SAFETENSORS_INDEX
    if not index.exists():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model directory {root} has no *.safetensors files")
        return files
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map (tensor name -> shard file)")
    files = []
    for name in sorted(set(weight_map.values())):
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{index} names {name!r} as a shard: expected a file name")
        path = root / name
        if not path.is_file():
            raise ValueError(f"{index} names shard {name}, which is not in {root}")
        files.append(path)
    return files


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``path`` memory-mapped (``safetensors.safe_open``, torch tensors on the CPU); a
    ``ValueError`` naming it when it is not a complete safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    with handle as f:
        yield f
