"""compressed-tensors' `pack-quantized` layout (llm-compressor's output for GPTQ
and AWQ models, which vLLM serves): for a weight named `<module>.weight`,
`<module>.weight_packed` `int32 [out, ceil(in * bits / 32)]` (signed codes plus
`2**(bits-1)`, packed along the inputs, lowest bits first), `weight_scale`
`[out, groups]` (`[out, 1]` per channel), `weight_zero_point` (asymmetric only:
signed zero points plus `2**(bits-1)`, packed along the *outputs*, `int32
[ceil(out * bits / 32), groups]`; older files hold them unpacked in `int8`),
`weight_shape` `[out, in]`, and from older versions `weight_g_idx` (act-order).

compressed-tensors dequantises `(q - zero_point) * scale` in the scale's dtype,
with `q` and `zero_point` signed; `GroupedIntArray` keeps the unsigned codes and
the zero point plus the same offset, whose difference is the same integer."""

import re
from typing import Any

import numpy as np

from ._gptq import drop_trivial_g_idx, grouped
from ._layer import Layer
from ._packing import unpack_words
from ._source import Source


SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")

_FORMAT_MSG = (
    "`load_safetensors`: the checkpoint's compressed-tensors format is {got!r}; only "
    '"pack-quantized" (integer codes packed in int32 words) is read here. '
    "{hint}"
)
_FORMAT_HINTS = {
    "int-quantized": "Its int8 weights are plain `weight` tensors with `weight_scale`.",
    "float-quantized": "FP8 weights have no reader here.",
    "naive-quantized": "Its codes are plain `weight` tensors with `weight_scale`.",
}
_CONFIG_MSG = "`load_safetensors`: {name!r} is compressed-tensors `pack-quantized`, but {what}."


def is_packed(name: str, source: Source) -> bool:
    """Whether the weight `name` (`<module>.weight`) is stored `pack-quantized`."""
    return name.endswith("weight") and f"{name}_packed" in source


def _weights_args(config: dict[str, Any] | None, module: str) -> dict[str, Any]:
    """The `weights` arguments of the config group whose targets name `module`
    (exactly, or by a `re:` pattern), else of the first group that targets a
    class of layers (`"Linear"`); empty without a config (the tensors then tell)."""
    if not config:
        return {}
    got = config.get("format", "pack-quantized")
    if got not in (None, "pack-quantized", "mixed-precision"):
        hint = _FORMAT_HINTS.get(got, "")
        raise ValueError(_FORMAT_MSG.format(got=got, hint=hint))
    by_class = []
    for group in (config.get("config_groups") or {}).values():
        if not group.get("weights"):
            continue
        for target in group.get("targets") or []:
            if target == module or (
                target.startswith("re:") and re.fullmatch(target[3:], module) is not None
            ):
                return dict(group["weights"])
            if not target.startswith("re:") and "." not in target and target[:1].isupper():
                by_class.append(dict(group["weights"]))
    return by_class[0] if by_class else {}


def read_packed(
    name: str, source: Source, path: str, shape: tuple[int, ...], config: dict | None
) -> Layer:
    """The weight `name` as a `GroupedIntArray` of shape `shape` `(out, in)`."""
    args = _weights_args(config, name[: -len(".weight")])
    if args.get("type", "int") != "int":
        raise ValueError(_CONFIG_MSG.format(name=name, what=f"its codes are {args['type']!r}"))
    out, columns = shape
    if f"{name}_shape" in source:
        theirs = tuple(int(n) for n in source.get(f"{name}_shape"))
        if theirs != tuple(shape):
            what = f"its `weight_shape` is {theirs} and the leaf `{path}` has shape {shape}"
            raise ValueError(_CONFIG_MSG.format(name=name, what=what))
    packed = source.get(f"{name}_packed")
    bits = args.get("num_bits")
    if bits is None:  # one file: the bits that give this many words
        fits = [b for b in (2, 4, 8) if -(-columns * b // 32) == packed.shape[-1]]
        bits = fits[0] if len(fits) == 1 else None
    if bits not in (2, 4, 8) or packed.shape != (out, -(-columns * bits // 32)):
        what = (
            f"its `weight_packed` {packed.shape} does not hold {columns} codes of 2, 4 or "
            f"8 bits per row for the leaf `{path}` of shape {shape}"
        )
        raise ValueError(_CONFIG_MSG.format(name=name, what=what))
    scale = source.get(f"{name}_scale")
    if scale.ndim < 2:  # one scale for the tensor
        scale = np.broadcast_to(scale.reshape(1, 1), (out, 1))
    groups = scale.shape[-1]
    offset = 2 ** (bits - 1)
    zeros = None
    if f"{name}_zero_point" in source:
        stored = source.get(f"{name}_zero_point")
        if stored.dtype == np.int32 and stored.shape[0] == -(-out * bits // 32):
            zeros = unpack_words(stored.T, bits, out).T  # unsigned: zp + offset
        elif stored.size == out * groups:
            zeros = stored.reshape(out, groups).astype(np.int32) + offset
        elif stored.size == 1 or np.all(stored == 0):
            zeros = None if np.all(stored == 0) else np.full((out, groups), stored + offset)
        else:
            what = f"its `weight_zero_point` {stored.shape} fits neither {out} rows nor packing"
            raise ValueError(_CONFIG_MSG.format(name=name, what=what))
    if args.get("symmetric") is False and zeros is None and f"{name}_zero_point" not in source:
        what = "its config says asymmetric and it has no `weight_zero_point`"
        raise ValueError(_CONFIG_MSG.format(name=name, what=what))
    g_idx = source.get(f"{name}_g_idx") if f"{name}_g_idx" in source else None
    g_idx = drop_trivial_g_idx(g_idx, columns, groups)
    if g_idx is None and columns % groups:
        what = f"its {groups} groups do not divide the {columns} inputs"
        raise ValueError(_CONFIG_MSG.format(name=name, what=what))
    return grouped(packed, scale, zeros, g_idx, bits, columns)
