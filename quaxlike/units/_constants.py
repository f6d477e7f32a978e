"""Plain numbers that fit every unit: 0, +-inf and NaN, when their value is known.

As in astropy, a quantity may be added to, compared with, or selected alongside
a plain number that is 0, +-inf or NaN in every element: those values are the same
in every unit. JAX's own `jax.numpy` code relies on it (`jnp.var` fills with NaN
where there are too few elements, `jnp.hypot` compares with inf, `jnp.median`
puts NaN where the input has one), so without it such functions refuse
quantities. Any other plain number counts as dimensionless, and a plain number
whose value is not known while tracing is refused next to a dimensioned quantity:
it could be anything. Inside `plain_constants_take_units`, a plain number whose
value is known is read in the unit of the quantity it meets instead.

A plain operand's value is known when it is concrete (a Python or NumPy number,
a literal of a jaxpr, a `jax.Array` outside any trace), or when it was computed
from such values alone while a `Unitful` is lifted (`Unitful.tracks_known_values`
asks quaxlike to note it: `quaxlike.internal.known_value`), so a constant made
inside a `jit`, a loop's body or a custom derivative's function stays known.
Some values are known to be 0, inf or NaN without being known
(`quaxlike.internal.is_scale_invariant`: `direction * jnp.inf`). Nothing is
computed unless a rule asks, and the program itself is unchanged.
"""

import contextvars
import functools as ft
from collections.abc import Callable
from typing import Any

import numpy as np

from quaxlike.internal import carry_into_backward_passes, is_scale_invariant, known_value


def fits_every_unit(x: Any) -> bool:
    """Whether the plain operand `x` is known to be 0, +-inf or NaN everywhere
    (`quaxlike.internal.is_scale_invariant`: its value is known, or the
    operations that made it give only such values, as `direction * jnp.inf`).

    The dtype's smallest normal number (`+-finfo.tiny`) counts as 0: it is what
    floating point puts in place of the number next to 0 (Equinox's `nextafter`
    and `prevbefore`, which diffrax uses to step just past a time, flush the
    denormal next to 0 to it), not an amount measured in some unit."""
    if is_scale_invariant(x):
        return True
    value = known_value(x)
    if value is None or not np.issubdtype(value.dtype, np.inexact):
        return False
    tiny = np.finfo(value.dtype).tiny
    nearly_zero = (value == 0) | (np.abs(value) == tiny)
    return bool(np.all(nearly_zero | np.isinf(value) | np.isnan(value)))


_reading_constants_in_unit = contextvars.ContextVar("unitful_constants_take_units", default=False)
# A `custom_vjp`'s backward pass (diffrax's adjoint) reads constants as its
# forward pass did, though JAX runs it after the function has returned.
carry_into_backward_passes(_reading_constants_in_unit)


def plain_constants_take_units(fn: Callable) -> Callable:
    """`fn`, in which a plain number known while tracing takes the unit of the
    quantity it meets.

    Numerical libraries hold tolerances and safeguards as plain numbers: diffrax's
    `PIDController` adds its `atol` to `rtol * |y|` for every part of the state
    (a position in m and a velocity in m/s alike), and its first step compares
    times with plain constants. Outside this function such a number counts as
    dimensionless and is refused beside a quantity in metres. Inside it, a plain
    number whose value is known while tracing (a Python number, a literal, a
    constant computed from them) is read in the unit of the quantity it meets,
    as the same code would read it on the quantities' numbers in their units:
    `atol=1e-6` is 1e-6 m beside metres and 1e-6 m/s beside metres per second.
    A plain value that is not known while tracing is still refused.

    The choice is the function's own, not a setting: calls of the returned
    function trace with it, under `jax.jit` too, and other calls without it.

    **Arguments:**

    - `fn`: the function to quaxify (or already quaxified).

    **Returns:**

    A function that calls `fn` with known plain numbers read in the unit they meet.

    !!! example

        ```python
        from quaxlike.units import m, plain_constants_take_units, s, Unitful

        def step(x, v, dt):
            return x + v * dt + 1e-3  # a safeguard, meant in the unit of `x`

        x, v = Unitful(jnp.ones(2), m), Unitful(jnp.ones(2), m / s)
        out = plain_constants_take_units(quaxlike.quaxify(step))(x, v, Unitful(jnp.array(0.1), s))
        assert out.unit == m and jnp.allclose(out.array, 1.101)
        ```
    """

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _reading_constants_in_unit.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _reading_constants_in_unit.reset(token)

    return wrapper


def reading_constants_in_unit() -> bool:
    """Whether known plain numbers take the unit they meet here."""
    return _reading_constants_in_unit.get()


def takes_any_unit(x: Any) -> bool:
    """Whether the plain operand `x` may stand beside a quantity of any unit:
    it fits every unit (`fits_every_unit`), or it is known while tracing inside
    `plain_constants_take_units`."""
    if fits_every_unit(x):
        return True
    return _reading_constants_in_unit.get() and known_value(x) is not None
