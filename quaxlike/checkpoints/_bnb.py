"""bitsandbytes' 4-bit layout, as transformers' `save_pretrained` writes a
`Linear4bit` weight: under the weight's name, the packed codes and, beside them,
`.absmax`, `.quant_map`, the nested statistics `.nested_absmax` and
`.nested_quant_map`, and `.quant_state.bitsandbytes__nf4` (or `__fp4`), a JSON
blob in a `uint8` tensor holding the rest of bitsandbytes' `QuantState`."""

import json
from typing import Any

import numpy as np

from quaxlike.quantized import Bnb4bitArray

from ._layer import Layer
from ._source import Source


STATE_KEYS = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")

_ODD_MSG = (
    "`load_safetensors`: {name!r} is bitsandbytes 4-bit with rows of {columns} "
    "inputs, an odd number: a byte of two codes would straddle two rows, and "
    "`Bnb4bitArray` keeps whole bytes in each row. Load this weight dense instead "
    "(dequantise it with bitsandbytes) or leave it out of the name map."
)
_SHAPE_MSG = (
    "`load_safetensors`: {name!r} is a bitsandbytes 4-bit weight of shape {theirs} "
    "(its quant state's `shape`), but the model's leaf `{path}` has shape {ours}."
)
_NESTED_DTYPE_MSG = (
    "`load_safetensors`: {name!r} has nested statistics in {dtype}; bitsandbytes "
    "writes them in float32, and no other dtype is read here."
)
_EIGHT_BIT_MSG = (
    "`load_safetensors`: {name!r} is a bitsandbytes 8-bit (LLM.int8) weight "
    "(`{name}` with `.SCB` beside it), a layout this loader does not read. Only "
    "4-bit (`load_in_4bit`) checkpoints are read; load the original float "
    "checkpoint and `quantize` it here instead."
)


def is_bnb_4bit(name: str, source: Source) -> bool:
    """Whether `name` is stored in bitsandbytes' 4-bit layout."""
    return name in source and any(f"{name}.{key}" in source for key in STATE_KEYS)


def check_not_8bit(name: str, source: Source) -> None:
    if f"{name}.SCB" in source:
        raise ValueError(_EIGHT_BIT_MSG.format(name=name))


def quant_state(name: str, source: Source) -> dict[str, Any]:
    """The JSON part of bitsandbytes' quant state for the weight `name`."""
    key = next(f"{name}.{k}" for k in STATE_KEYS if f"{name}.{k}" in source)
    return json.loads(bytes(source.get(key).astype(np.uint8)).decode("utf-8"))


def windows(values: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Per row `r`, `values[first[r] : last[r] + 1]`, as a `(rows, m)` array for the
    longest such run (shorter runs padded with the last value)."""
    m = int(np.max(last - first)) + 1
    index = np.minimum(first[:, None] + np.arange(m), len(values) - 1)
    return values[index]


def read_bnb_4bit(name: str, source: Source, path: str, shape: tuple[int, ...]) -> Layer:
    """The weight `name` as a `Bnb4bitArray` of shape `shape` `(out, in)`."""
    state = quant_state(name, source)
    theirs = tuple(state["shape"])
    if theirs != tuple(shape):
        raise ValueError(_SHAPE_MSG.format(name=name, theirs=theirs, path=path, ours=shape))
    rows, columns = theirs
    blocksize = int(state["blocksize"])
    if columns % 2:
        raise ValueError(_ODD_MSG.format(name=name, columns=columns))
    # Any `quant_storage` dtype holds the same bytes: read them as `uint8`.
    packed = np.ascontiguousarray(source.get(name)).reshape(-1).view(np.uint8)
    packed = packed[: rows * columns // 2].reshape(rows, columns // 2)
    # The blocks each row meets (its own, when `blocksize` divides the row).
    flat = source.get(f"{name}.absmax").reshape(-1)
    first = np.arange(rows) * columns
    first_block, last_block = first // blocksize, (first + columns - 1) // blocksize
    absmax = windows(flat, first_block, last_block)
    fields: dict[str, Any] = dict.fromkeys(
        ("nested", "nested_start", "nested_code", "offset", "block_start")
    )
    static: dict[str, Any] = {
        "quant_type": state["quant_type"],
        "library_dtype": str(state["dtype"]),
    }
    if columns % blocksize:
        fields["block_start"] = (first % blocksize).astype(np.int32)[:, None]
        static["blocksize"] = blocksize
    if f"{name}.nested_absmax" in source:
        if state.get("nested_dtype", "float32") != "float32":
            raise ValueError(_NESTED_DTYPE_MSG.format(name=name, dtype=state["nested_dtype"]))
        size = int(state["nested_blocksize"])
        nested_flat = source.get(f"{name}.nested_absmax").astype(np.float32)
        last_used = first_block + absmax.shape[1] - 1  # padded windows included
        nested = windows(nested_flat, first_block // size, last_used // size)
        fields.update(
            nested=nested.astype(np.float32),
            nested_start=(first_block % size).astype(np.int32)[:, None],
            nested_code=source.get(f"{name}.nested_quant_map").astype(np.float32),
            offset=np.asarray(state["nested_offset"], np.float32),
        )
        static["nested_blocksize"] = size
        absmax = absmax.astype(np.uint8)
    else:
        absmax = absmax.astype(np.float32)
    fields.update(
        packed=packed, absmax=absmax, code=source.get(f"{name}.quant_map").astype(np.float32)
    )
    return Layer(Bnb4bitArray, fields, static)
