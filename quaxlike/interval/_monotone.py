"""The primitives that `Interval.default` bounds by applying them to each bound.

A primitive belongs here when it is non-decreasing in every operand an `Interval`
may occupy: then `f(lo)` and `f(hi)` are exactly the bounds of `f` over the
bracket, with no rule of its own. Anything that is not (`sin`, `abs`, `neg`,
`sub`, `mul`, a comparison) must have a rule in `_rules.py`, or it is refused.
"""

from typing import Any, Final

import numpy as np
from jax import lax


MONOTONE: Final = frozenset(
    {
        # Each output element is one input element, or the largest/smallest or sum
        # of several: moving, copying, selecting and gathering elements.
        lax.broadcast_in_dim_p,
        lax.concatenate_p,
        lax.copy_p,
        lax.dynamic_slice_p,
        lax.gather_p,
        lax.pad_p,
        lax.reduce_max_p,
        lax.reduce_min_p,
        lax.reshape_p,
        lax.rev_p,
        lax.select_n_p,
        lax.slice_p,
        lax.squeeze_p,
        lax.transpose_p,
        lax.cummax_p,
        lax.cummin_p,
        # Non-decreasing elementwise functions of one operand.
        lax.asinh_p,
        lax.atan_p,
        lax.cbrt_p,
        lax.ceil_p,
        lax.convert_element_type_p,
        lax.erf_p,
        lax.exp2_p,
        lax.exp_p,
        lax.expm1_p,
        lax.floor_p,
        lax.log1p_p,
        lax.log_p,
        lax.logistic_p,
        lax.round_p,
        lax.sqrt_p,
        lax.tanh_p,
        # Non-decreasing in every operand they combine.
        lax.add_p,
        lax.cumsum_p,
        lax.max_p,
        lax.min_p,
        lax.reduce_sum_p,
    }
)
"""Primitives non-decreasing in each operand, which `Interval.default` handles by
binding them once on the lower bounds and once on the upper bounds."""


def conversion_refusal(params: dict[str, Any], source_dtype: np.dtype) -> str | None:
    """Why a `convert_element_type` of an `Interval` is not monotone, or `None`.

    Converting between real number types (float to float, float to int, which
    truncates) is non-decreasing. Converting a number to `bool` (`x != 0`) is not,
    and complex numbers have no order.

    **Arguments:**

    - `params`: the parameters of the `convert_element_type` equation.
    - `source_dtype`: the dtype of the `Interval` being converted.

    **Returns:**

    A sentence saying why the conversion is refused, or `None` if it is monotone.
    """
    target = np.dtype(params["new_dtype"])
    source = np.dtype(source_dtype)
    if np.issubdtype(target, np.complexfloating) or np.issubdtype(source, np.complexfloating):
        return f"complex numbers have no order, so {source} -> {target} has no bounds"
    if target == np.bool_ and source != np.bool_:
        return f"{source} -> bool is `x != 0`, which is not monotone"
    return None
