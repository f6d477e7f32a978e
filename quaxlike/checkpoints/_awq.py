"""AutoAWQ's GEMM layout: under a module's name, `qweight` `int32 [in, out * bits /
32]` (codes packed along the outputs), `qzeros` `int32 [groups, out * bits / 32]`,
`scales` `[groups, out]`; within each word the eight 4-bit codes belong to
outputs `[0, 2, 4, 6, 1, 3, 5, 7]` of its eight, lowest bits first (the order
AutoAWQ's GEMM kernel reads). Zero points are stored as they are.

The codes are repacked once, at load, into `GroupedIntArray`'s layout (packed
along the inputs, in order): one `uint8` copy of a layer's codes exists while
that layer is read, never a float one."""

from typing import Any

import numpy as np

from quaxlike.quantized import pack_words

from ._gptq import grouped
from ._layer import Layer
from ._packing import unpack_words
from ._source import Source


#: Output `AWQ_ORDER[j]` of each eight is in field `j` of a word.
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])

_VERSION_MSG = (
    "`load_safetensors`: the checkpoint's AWQ `version` is {got!r}; only AutoAWQ's "
    '"gemm" layout is read (GEMV and the kernels\' own layouts pack the codes '
    "differently). Convert it to GEMM with AutoAWQ, or load the float model and "
    "`quantize` it here."
)
_SHAPE_MSG = (
    "`load_safetensors`: {module} is AWQ with qweight {qweight} and scales {scales}, "
    "which do not fit the leaf `{path}` of shape {shape} `(out, in)` with 4-bit "
    "codes (`qweight` `[in, out / 8]`, `scales` `[groups, out]`, groups dividing in)."
)


def unpack_awq(words: np.ndarray, columns: int) -> np.ndarray:
    """`uint8` codes `(..., columns)` of AWQ words `(..., columns / 8)`, in column
    order."""
    fields = unpack_words(words, 4)  # field order within each word
    fields = fields.reshape(*words.shape[:-1], -1, 8)
    ordered = np.empty_like(fields)
    ordered[..., AWQ_ORDER] = fields
    return ordered.reshape(*words.shape[:-1], -1)[..., :columns]


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """The inverse of `unpack_awq` (for tests and writers): `(..., 8k)` to words."""
    fields = codes.reshape(*codes.shape[:-1], -1, 8)[..., AWQ_ORDER]
    return pack_words(fields.reshape(codes.shape), 4)


def awq_version(config: dict[str, Any] | None) -> None:
    got = str((config or {}).get("version", "gemm")).lower()
    if got != "gemm":
        raise ValueError(_VERSION_MSG.format(got=got))


def read_awq(
    module: str, source: Source, path: str, shape: tuple[int, ...], config: dict | None
) -> Layer:
    """The weight of `module` (AWQ GEMM) as a `GroupedIntArray` of shape `(out, in)`."""
    awq_version(config)
    out, columns = shape
    qweight = source.get(f"{module}.qweight")
    scales = source.get(f"{module}.scales")
    ok = (
        qweight.shape == (columns, out // 8)
        and out % 8 == 0
        and scales.ndim == 2
        and scales.shape[1] == out
        and columns % scales.shape[0] == 0
    )
    if not ok:
        raise ValueError(
            _SHAPE_MSG.format(
                module=module,
                qweight=qweight.shape,
                scales=scales.shape,
                path=path,
                shape=shape,
            )
        )
    codes = unpack_awq(qweight, out).T  # (out, in)
    zeros = unpack_awq(source.get(f"{module}.qzeros"), out).T  # (out, groups)
    return grouped(pack_words(codes, 4), scales.T, zeros, None, 4, columns)
