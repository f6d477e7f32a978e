"""`quantize` with `method="gptq"` or `"awq"` (and `bits=3` or `2`): record the
selected weights' inputs on the calibration data (`_calibration.py`), then
choose each weight's codes from them (`_gptq.py`, `_awq.py`)."""

import dataclasses
import functools as ft
from collections.abc import Callable, Iterable
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

from ..selection import is_value, replace_selected, selected
from ._awq import AWQ, awq_scales, InputScaled
from ._base import as_float_matrix, check_block_bytes, check_group_size, pack_nibbles
from ._calibration import CalibrationError, collect_statistics
from ._gptq import GPTQ, gptq_codes
from ._nf4 import quantize_nf4
from ._rounding import build, CODE_MAX, Grid, grid_for, rtn_codes
from ._value import _BAD_BITS_MSG, default_where, quantize_int4, quantize_int8


_BAD_METHOD_MSG = (
    '`quantize`: `method` must be "rtn" (round to nearest), "gptq", "awq", or a '
    "`GPTQ(...)` or `AWQ(...)` with options; got {got!r}."
)
_RTN_CALIBRATION_MSG = (
    '`quantize(method="rtn")` rounds each weight to the nearest code and takes no '
    'calibration data; `calibration=` and `run=` are for `method="gptq"` or '
    '`"awq"`. Pass one of those, or leave `calibration` and `run` out.'
)


def _method(method: Any) -> GPTQ | AWQ | None:
    if isinstance(method, (GPTQ, AWQ)):
        return method
    if isinstance(method, str) and method in ("gptq", "awq", "rtn"):
        return {"gptq": GPTQ(), "awq": AWQ(), "rtn": None}[method]
    raise ValueError(_BAD_METHOD_MSG.format(got=method))


def _rounder(grid: Grid, bits: Any, double_quant: bool, options: dict) -> Callable:
    """Round-to-nearest of one dense weight into its quantised type, as
    `quantize(method="rtn")` does."""
    if bits == 8:
        return ft.partial(quantize_int8, **options)
    if bits == 4:
        return ft.partial(quantize_int4, group_size=grid.group_size, **options)
    if bits == "nf4":
        return ft.partial(
            quantize_nf4, group_size=grid.group_size, double_quant=double_quant, **options
        )

    def lower_bits(w):
        codes, scale = rtn_codes(grid, w)
        return build(grid, codes, scale, w.dtype, **options)

    return lower_bits


def _weight(leaf: Any, grid: Grid) -> Any:
    w = as_float_matrix(leaf, "quantize")
    if grid.group_size is not None:
        check_group_size(w.shape, grid.group_size, "quantize")
    return w


def _gptq(w, stats, grid, rounder, double_quant, options, method: GPTQ):
    if grid.kind == "nf4" and double_quant:
        # The absmaxes are stored in 8 bits: round them first, then GPTQ with the
        # absmaxes as stored (static groups).
        stored = rounder(w)
        absmax = stored.group_absmax(*stored.row_leaves()[1:])
        codes, _ = gptq_codes(grid, w, stats.gram, method, fixed_scales=absmax)
        return dataclasses.replace(stored, packed=pack_nibbles(codes))
    codes, scale = gptq_codes(grid, w, stats.gram, method)
    return build(grid, codes, scale, w.dtype, **options)


def _awq(w, stats, grid, rounder, method: AWQ):
    mean_abs = stats.absum / stats.rows[..., None]
    scale, _ = awq_scales(grid, w, stats.gram, mean_abs, method)
    scale = scale.astype(w.dtype)
    return InputScaled(rounder(w * scale[..., None, :]), scale)


def calibrated_quantize(
    model: PyTree,
    method: Any,
    calibration: Iterable[Any] | None,
    run: Callable[[Any, Any], Any] | None,
    bits: Any,
    group_size: int | None,
    double_quant: bool,
    where: Any,
    options: dict,
) -> PyTree:
    """`quantize` for `method` other than `"rtn"`, or `bits` 3 or 2 (see there)."""
    chosen = _method(method)
    if isinstance(bits, bool) or not (bits == "nf4" or bits in CODE_MAX):
        raise ValueError(_BAD_BITS_MSG.format(bits=bits))
    check_block_bytes(options["block_bytes"], "quantize")
    grid = grid_for(bits, group_size)
    rounder = _rounder(grid, bits, double_quant, options)
    if where is None:
        where = default_where(model)
    if chosen is None:
        if calibration is not None or run is not None:
            raise CalibrationError(_RTN_CALIBRATION_MSG)
        return replace_selected(model, where, lambda w: rounder(_weight(w, grid)), "quantize")
    name = "gptq" if isinstance(chosen, GPTQ) else "awq"
    if calibration is None:
        calibration = []  # collect_statistics says what is missing
    leaves, treedef = jtu.tree_flatten(model, is_leaf=is_value)
    # The weights are checked before anything runs: a bad group size says so now.
    weights = {i: _weight(leaves[i], grid) for i in selected(model, where, "quantize")}

    def quantised(w, stat):
        if isinstance(chosen, GPTQ):
            return _gptq(w, stat, grid, rounder, double_quant, options, chosen)
        return _awq(w, stat, grid, rounder, chosen)

    if isinstance(chosen, GPTQ) and chosen.sequential:
        calibration = list(calibration)  # run once per weight
        for position in weights:
            # The weights before this one are quantised Values in the model now.
            current = jtu.tree_unflatten(treedef, leaves)
            _, (stat,) = collect_statistics(current, where, calibration, run, name, [position])
            leaves[position] = quantised(weights[position], stat)
        return jtu.tree_unflatten(treedef, leaves)
    positions, stats = collect_statistics(model, where, calibration, run, name)
    for position, stat in zip(positions, stats):
        leaves[position] = quantised(weights[position], stat)
    return jtu.tree_unflatten(treedef, leaves)
