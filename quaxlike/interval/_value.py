"""The `Interval` type and the fallback that bounds every monotone primitive."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import ShapedArray, with_leaf_specs

from ._monotone import conversion_refusal, MONOTONE


class Interval(quaxlike.ArrayValue):
    """An array known only to lie between a lower and an upper bound, elementwise.

    Inside `quaxlike.quaxify`, every operation maps the bounds forward, so the
    result brackets what the same computation gives for any values inside the
    input brackets: put the uncertainty of the inputs in, read the width of the
    output.

    Operations that are non-decreasing in their operands (moving elements, sums,
    `exp`, `sqrt`, ... : see `MONOTONE`) need no rule: `default` applies them to
    each bound. `sub`, `neg`, `mul`, `integer_pow`, `abs` and `div` by a plain
    array have rules. Everything else raises, and so does `materialise`: an
    interval silently collapsed to one array would be a wrong answer that looks
    right.

    Two limits, both inherent to the method:

    - Each operation treats its operands as independent, so a value used twice
      widens the result: `x * x` over `[-1, 2]` gives `[-2, 4]`, while `x ** 2`
      gives the true range `[0, 4]`. Both contain the true range.
    - The bounds are computed in ordinary floating point (JAX has no directed
      rounding), so each carries the usual rounding error: good for estimating
      uncertainty, not for verified computation.

    **Arguments:**

    - `lo`: the lower bounds (anything `jnp.asarray` accepts).
    - `hi`: the upper bounds, of the same shape. That `lo <= hi` is not checked:
      it depends on the values, which are unknown while tracing.

    !!! example

        ```python
        x = Interval(1.0, 2.0)
        y = quaxlike.quaxify(lambda a: 3.0 * a - a**2)(x)
        print(y.lo, y.hi)  # -1.0 5.0: contains 3x - x**2 for every x in [1, 2]
        ```
    """

    lo: Array = eqx.field(converter=jnp.asarray)
    hi: Array = eqx.field(converter=jnp.asarray)

    def __check_init__(self):
        if jnp.shape(self.lo) != jnp.shape(self.hi):
            raise ValueError(
                "Interval: the bounds must have the same shape, got "
                f"lo {jnp.shape(self.lo)} and hi {jnp.shape(self.hi)}. Broadcast them "
                "first (jnp.broadcast_arrays(lo, hi))."
            )

    def logical_leaf_specs(self, spec: Any) -> "Interval":
        """Both bounds have the value's shape and follow its sharding (see `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return with_leaf_specs(self, lo=spec, hi=spec)

    def aval(self) -> ShapedArray:
        return ShapedArray(jnp.shape(self.lo), jnp.result_type(self.lo, self.hi))

    def materialise(self):
        raise ValueError(
            "Refusing to materialise an Interval: no single array carries both "
            "bounds, so the uncertainty would be dropped without a word. Read "
            "`.lo` and `.hi`, or register a rule for the primitive that needed "
            "an ordinary array (quaxlike.register(primitive))."
        )

    @property
    def width(self) -> Array:
        """`hi - lo`: how wide the bracket is, elementwise."""
        return self.hi - self.lo

    @staticmethod
    def default(primitive, values: Sequence[Any], params: dict[str, Any]):
        """Bound a primitive that has no rule, if it is non-decreasing.

        For a primitive in `MONOTONE`, binding it on the lower bounds and on the
        upper bounds gives exactly the bounds of its result. For any other
        primitive the same recipe is wrong, not merely loose (`sin` over
        `[0, 2 pi]` would claim exactly `[0, 0]`), so it raises instead.

        **Arguments:**

        - `primitive`: the primitive that has no `Interval` rule.
        - `values`: its operands, `Interval`s and plain arrays.
        - `params`: its parameters.

        **Returns:**

        An `Interval` (or a list of them, for a multiple-results primitive).
        """
        if primitive not in MONOTONE:
            handled = ", ".join(sorted(p.name for p in MONOTONE))
            raise ValueError(
                f"Interval has no rule for `{primitive.name}`, and `{primitive.name}` "
                "is not known to be non-decreasing in its operands, so applying it "
                "to each bound would not bound its result. Register a rule for it "
                "(quaxlike.register on a function of Interval arguments) that "
                f"computes sound bounds. Handled by default: {handled}."
            )
        if primitive is lax.select_n_p and isinstance(values[0], Interval):
            raise ValueError(
                "Interval: `select_n` (jnp.where) is monotone in its cases but not in "
                "its predicate: an uncertain predicate may pick either case. Use a "
                "plain boolean array as the predicate."
            )
        if primitive is lax.convert_element_type_p:
            (operand,) = values
            why = conversion_refusal(params, operand.dtype)
            if why is not None:
                raise ValueError(f"Interval: cannot convert the bounds: {why}.")
        lows = [v.lo if isinstance(v, Interval) else v for v in values]
        highs = [v.hi if isinstance(v, Interval) else v for v in values]
        lo = primitive.bind(*lows, **params)
        hi = primitive.bind(*highs, **params)
        if primitive.multiple_results:
            return [Interval(a, b) for a, b in zip(lo, hi, strict=True)]
        return Interval(lo, hi)


def bounds(x: "Interval | ArrayLike") -> tuple[Any, Any]:
    """The bounds of `x`; a plain array is an interval of width zero.

    **Arguments:**

    - `x`: an `Interval` or a plain array.

    **Returns:**

    `(lo, hi)`.
    """
    if isinstance(x, Interval):
        return x.lo, x.hi
    return x, x
