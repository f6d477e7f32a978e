from collections.abc import Sequence
from typing import Any

import jax

from .. import _jax_compat as jc
from .._values import checked_aval, Value


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    aval = checked_aval(x) if isinstance(x, Value) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def output_aval(primitive: jc.Primitive, args: Sequence[Any], params: dict[str, Any]):
    """The aval `primitive.bind(*args, **params)` would return, worked out abstractly.

    **Arguments:**

    - `primitive`: the primitive.
    - `args`: its operands; Values count as arrays of their `aval()`.
    - `params`: its parameters.

    **Returns:**

    A `ShapedArray` (a list of them for a primitive with multiple results). No
    operation is added to any traced program.
    """
    out = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *map(_struct, args))
    to_aval = lambda s: jc.ShapedArray(s.shape, s.dtype, weak_type=s.weak_type)  # noqa: E731
    return [to_aval(s) for s in out] if primitive.multiple_results else to_aval(out)
