"""GPTQ's layout (auto-gptq, GPTQModel, transformers/optimum): under a module's
name, `qweight` `int32 [in * bits / 32, out]` (codes packed along the inputs,
lowest bits first), `qzeros` `int32 [groups, out * bits / 32]` (packed along the
outputs), `scales` `[groups, out]` and `g_idx` `int32 [in]` (each input's group:
act-order, `desc_act`, when it is not `i // group_size`).

Two conventions for the zero points. The original one ("v1", `checkpoint_format
"gptq"`, what auto-gptq, optimum and GPTQModel write by default) stores each
zero point minus one; GPTQModel's "v2" (`"gptq_v2"`) stores it as it is. A file
does not say which: the checkpoint's `config.json` does. Without it, v1 is
taken, as GPTQModel and transformers take it, since every GPTQ writer saves v1
unless told otherwise. v1 is turned into v2 as GPTQModel does it: one added to
every field of each packed `qzeros` word at once, as an integer addition (a
stored field at its maximum carries into the next, in GPTQModel as here)."""

from typing import Any

import numpy as np

from quaxlike.quantized import GroupedIntArray

from ._layer import Layer
from ._packing import unpack_words
from ._source import Source


GPTQ_KEYS = ("qweight", "qzeros", "scales")
_V1_ONES = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}

_FORMAT_MSG = (
    "`load_safetensors`: the checkpoint's `checkpoint_format` is {got!r}; GPTQ is read "
    'in the "gptq" (v1) and "gptq_v2" layouts only ({what}). Convert the checkpoint '
    "to one of them with GPTQModel, or load the float model and `quantize` it here."
)
_BITS_MSG = (
    "`load_safetensors`: {module}.qweight has shape {qweight}, which for the leaf "
    "`{path}` of shape {shape} `(out, in)` means {bits} bits per code{why}. GPTQ is "
    "read with 2, 4 or 8 bits (3-bit codes straddle the int32 words)."
)
_GROUPS_MSG = (
    "`load_safetensors`: {module}.scales has shape {scales}, which does not fit "
    "`qweight` {qweight} for a weight of shape {shape} (`(groups, out)` expected)."
)


def gptq_format(config: dict[str, Any] | None) -> str:
    """`"v1"` or `"v2"`, from a `quantization_config` (v1 without one)."""
    got = (config or {}).get("checkpoint_format", (config or {}).get("format", "gptq"))
    got = "gptq" if got is None else str(got).lower()
    if got == "gptq":
        return "v1"
    if got == "gptq_v2":
        return "v2"
    what = "marlin, bitblas and the other kernels' repacked layouts are theirs alone"
    raise ValueError(_FORMAT_MSG.format(got=got, what=what))


def code_bits(module: str, qweight_dim: int, columns: int, path: str, shape, qshape) -> int:
    """Bits per code, from how many `int32` words hold `columns` codes."""
    bits, remainder = divmod(qweight_dim * 32, columns)
    if remainder or bits not in (2, 4, 8):
        why = "" if not remainder else " (not a whole number)"
        raise ValueError(
            _BITS_MSG.format(
                module=module, qweight=qshape, path=path, shape=shape, bits=bits, why=why
            )
        )
    return bits


def drop_trivial_g_idx(g_idx: np.ndarray | None, columns: int, groups: int) -> np.ndarray | None:
    """`None` where `g_idx` is `i // group_size` (no act-order) or all -1 (unset)."""
    if g_idx is None or np.all(g_idx == -1):
        return None
    if columns % groups == 0 and np.array_equal(g_idx, np.arange(columns) // (columns // groups)):
        return None
    return g_idx.astype(np.int32)


def grouped(
    codes_words: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    g_idx: np.ndarray | None,
    bits: int,
    columns: int,
) -> Layer:
    """A `GroupedIntArray`'s fields from stored-layout NumPy arrays `(out, ...)`;
    zero points equal to the symmetric midpoint everywhere are left out."""
    if zeros is not None and np.all(zeros == 2 ** (bits - 1)):
        zeros = None
    arrays = {
        "packed": np.ascontiguousarray(codes_words),
        "scale": np.ascontiguousarray(scales),
        "zero": None if zeros is None else np.ascontiguousarray(zeros, np.int32),
        "g_idx": g_idx,
    }
    return Layer(GroupedIntArray, arrays, {"bits": bits, "columns": columns})


def read_gptq(
    module: str, source: Source, path: str, shape: tuple[int, ...], config: dict | None
) -> Layer:
    """The weight of `module` (GPTQ) as a `GroupedIntArray`'s fields of shape `(out, in)`:
    `qweight` transposed (its words already hold consecutive inputs), the zero
    points unpacked (and v1's made v2)."""
    out, columns = shape
    qshape = source.shape(f"{module}.qweight")
    bits = code_bits(module, qshape[0], columns, path, shape, qshape)
    version = gptq_format(config)
    scales = source.get(f"{module}.scales")
    if scales.ndim != 2 or scales.shape[1] != out:
        raise ValueError(
            _GROUPS_MSG.format(module=module, scales=scales.shape, qweight=qshape, shape=shape)
        )
    groups = scales.shape[0]
    qzeros = source.get(f"{module}.qzeros")
    if version == "v1":
        qzeros = (qzeros.view(np.uint32) + np.uint32(_V1_ONES[bits])).view(np.int32)
    zeros = unpack_words(qzeros, bits, out)  # (groups, out)
    g_idx = source.get(f"{module}.g_idx") if f"{module}.g_idx" in source else None
    g_idx = drop_trivial_g_idx(g_idx, columns, groups)
    if g_idx is None and columns % groups:
        raise ValueError(
            _GROUPS_MSG.format(module=module, scales=scales.shape, qweight=qshape, shape=shape)
        )
    qweight = source.get(f"{module}.qweight")
    return grouped(qweight.T, scales.T, zeros.T, g_idx, bits, columns)
