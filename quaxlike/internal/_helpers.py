from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy  # noqa: F401  (`jax.numpy.zeros` below)
import numpy as np

from .. import _jax_compat as jc
from .._known_values import is_known, known_value
from .._values import checked_aval, Value


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    aval = cast(jc.ShapedArray, checked_aval(x)) if isinstance(x, Value) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


# Returns `Any`, as `primitive.bind` does: a `ShapedArray`, or a list of them when
# `primitive.multiple_results`, which only the caller knows statically.
def output_aval(primitive: jc.Primitive, args: Sequence[Any], params: dict[str, Any]) -> Any:
    """The aval `primitive.bind(*args, **params)` would return, worked out abstractly.

    **Arguments:**

    - `primitive`: the primitive.
    - `args`: its operands; Values count as arrays of their `aval()`.
    - `params`: its parameters.

    **Returns:**

    A `ShapedArray` (a list of them for a primitive with multiple results). No
    operation is added to any traced program.

    !!! example

        ```python
        from quaxlike.symbolic.zero import Zero

        aval = quaxlike.internal.output_aval(
            jax.lax.dot_general_p,
            [Zero((3, 4), jnp.float32), jnp.ones((4, 5))],
            dict(dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
                 preferred_element_type=jnp.float32, out_sharding=None),
        )
        assert aval.shape == (3, 5)
        ```
    """
    structs = list(map(_struct, args))
    try:
        # The primitive's own abstract evaluation: a hundred times cheaper than
        # tracing a call with `jax.eval_shape`, which is what rules that build
        # symbolic results (Zero's) pay on every primitive they handle.
        out, _ = primitive.abstract_eval(
            *(jc.ShapedArray(s.shape, s.dtype, weak_type=s.weak_type) for s in structs), **params
        )
    except Exception:
        # None for these avals (higher-order and call primitives), or params it
        # wants in the form `bind` gives them: trace the call instead, which
        # also raises the real error for operands that do not fit.
        out = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)
    to_aval = lambda s: jc.ShapedArray(s.shape, s.dtype, weak_type=s.weak_type)  # noqa: E731
    return [to_aval(s) for s in out] if primitive.multiple_results else to_aval(out)


def holding_known_zeros(value: Value, array: Any) -> Value | None:
    """`value` with every array leaf zero, standing for `array`, where `array` is
    a plain array known while tracing to be 0 everywhere (`known_value`): what a
    type whose array is a product of its leaves (a quantised weight, a banded
    matrix) gives from `Value.holding_plain`, so that a loop state that starts as
    zeros in its place keeps its type.

    A known value is computed from constants alone, so it carries no derivative
    that the zero leaves would drop. The type must set
    `Value.tracks_known_values` for values made under `jit` to be known.

    **Arguments:**

    - `value`: a Value whose array is 0 when all its leaves are.
    - `array`: the plain array it is asked to hold.

    **Returns:**

    The zero Value, or `None` where `array` is not known to be 0 or its shape
    or dtype differ from `value`'s.

    !!! example

        ```python
        from quaxlike.structured import TriDiagonal

        t = TriDiagonal(jnp.ones(2), jnp.ones(3), jnp.ones(2))
        held = quaxlike.internal.holding_known_zeros(t, jnp.zeros((3, 3)))
        assert isinstance(held, TriDiagonal) and not held.materialise().any()
        assert quaxlike.internal.holding_known_zeros(t, jnp.ones((3, 3))) is None
        ```
    """
    # The lookup first: a loop asks for every plain carry, most of them unknown,
    # and `aval()` is the type's own code.
    if not is_known(array):
        return None
    aval = cast(jc.ShapedArray, checked_aval(value))
    if jax.typeof(array).shape != aval.shape or jax.typeof(array).dtype != aval.dtype:
        return None
    known = known_value(array)
    if known is None or not bool(np.all(known == 0)):
        return None
    return jax.tree.map(lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype), value)
