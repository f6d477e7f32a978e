"""compressed-tensors' microscaling layouts, read as `MXArray` and `NVFP4Array`:
for a weight named `<module>.weight`,

- `nvfp4-pack-quantized`: `weight_packed` `uint8 [out, in / 2]` (e2m1 codes, low
  nibble first), `weight_scale` `float8_e4m3fn [out, in / 16]` and
  `weight_global_scale` `float32 [1]`; the library dequantises `value *
  (scale / global_scale)` in float32 and returns bfloat16;
- `mxfp4-pack-quantized`: `weight_packed` as above and `weight_scale` `uint8 [out,
  in / 32]`, E8M0 exponents; `value * 2 ** (scale - 127)`, bfloat16;
- `mxfp8-quantized`: `weight` itself in `float8_e4m3fn [out, in]` and
  `weight_scale` as for mxfp4.

Told apart from `pack-quantized` (integer codes in `int32` words) by the codes'
dtype, and from each other by the global scale. safetensors' NumPy reader has
no float8 dtype, so the e4m3 scales are read as their bytes."""

import json
from typing import Any

import numpy as np

from ..quantized import MXArray, NVFP4Array
from ._layer import Layer
from ._source import Source


NVFP4 = "compressed-tensors nvfp4-pack-quantized"
MXFP4 = "compressed-tensors mxfp4-pack-quantized"
MXFP8 = "compressed-tensors mxfp8-quantized"
LAYOUTS = (NVFP4, MXFP4, MXFP8)

_SHAPE_MSG = (
    "`load_safetensors`: {name!r} is {layout}, but its `{key}` has shape {got} where "
    "the leaf `{path}` of shape {shape} `(out, in)` needs {want}."
)
_DTYPE_MSG = (
    "`load_safetensors`: {name!r} is {layout}, but its `{key}` is {got}; the library writes {want}."
)


def microscaled_layout(name: str, source: Source) -> str | None:
    """The microscaling layout stored under the weight `name`, or None."""
    scale = f"{name}_scale"
    if name in source and source.dtype(name) == "F8_E4M3":
        return MXFP8 if scale in source and source.dtype(scale) == "U8" else None
    packed = f"{name}_packed"
    if not name.endswith("weight") or packed not in source or source.dtype(packed) != "U8":
        return None
    return NVFP4 if f"{name}_global_scale" in source else MXFP4


def _bytes(source: Source, key: str) -> np.ndarray:
    """The tensor `key` as its raw bytes, `uint8` of its shape, from the file's
    header (one-byte dtypes only: `U8`, `F8_E4M3`)."""
    for path in source.paths:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(size))
            if key not in header:
                continue
            start, end = header[key]["data_offsets"]
            f.seek(8 + size + start)
            data = np.frombuffer(f.read(end - start), np.uint8)
            return data.reshape(header[key]["shape"])
    raise KeyError(key)


def read_microscaled(
    name: str, layout: str, source: Source, path: str, shape: tuple[int, ...]
) -> Layer:
    """The weight `name` as an `MXArray` (mxfp4, mxfp8) or `NVFP4Array` of shape
    `shape`."""
    out, columns = shape
    block = 16 if layout == NVFP4 else 32
    scale_dtype = "F8_E4M3" if layout == NVFP4 else "U8"
    codes = name if layout == MXFP8 else f"{name}_packed"
    want = {
        codes: (out, columns if layout == MXFP8 else columns // 2),
        f"{name}_scale": (out, columns // block),
    }
    for key, expected in want.items():
        got = source.shape(key) if key in source else None
        if got != expected or columns % block:
            raise ValueError(
                _SHAPE_MSG.format(
                    name=name,
                    layout=layout,
                    key=key,
                    got=got,
                    path=path,
                    shape=shape,
                    want=expected if not columns % block else f"`in` a multiple of {block}",
                )
            )
    if source.dtype(f"{name}_scale") != scale_dtype:
        raise ValueError(
            _DTYPE_MSG.format(
                name=name,
                layout=layout,
                key=f"{name}_scale",
                got=source.dtype(f"{name}_scale"),
                want=scale_dtype,
            )
        )
    qdata = _bytes(source, codes)
    scale = _bytes(source, f"{name}_scale")
    # The library's decompressors return bfloat16; the loader casts to the leaf's.
    if layout in (MXFP4, MXFP8):
        fmt = "mxfp4" if layout == MXFP4 else "mxfp8"
        return Layer(
            MXArray, {"qdata": qdata, "scale": scale}, {"format": fmt, "dtype_name": "bfloat16"}
        )
    global_scale = np.asarray(source.get(f"{name}_global_scale"), np.float32)
    if global_scale.size != 1:
        what = f"a `weight_global_scale` of shape {global_scale.shape}"
        raise ValueError(
            _DTYPE_MSG.format(
                name=name, layout=layout, key=f"{name}_global_scale", got=what, want="one float32"
            )
        )
    return Layer(
        NVFP4Array,
        {"qdata": qdata, "scale": scale, "per_tensor_scale": global_scale.reshape(1, 1)},
        {"divide": True, "dtype_name": "bfloat16"},
    )
