"""`UnitfulArray`: an array with units as a hijax value, its type and its primitives.

Nothing here knows about quaxlike: this is an ordinary JAX high-level type. Its
type `UnitfulArrayTy` holds the units, so they print in jaxprs (`u[3]{m s^-1}`)
and JAX compares them when it checks types; its cotangent type has the inverse
units, which no pytree can express. Each operation is a primitive (`wrap`,
`unwrap`, `add`, `mul`, `int_pow`, `sum`, `broadcast_in_dim`) with its
expansion into ordinary `lax` operations and its `jvp`, `vjp` and `batch` rules.
`_value.py` puts a `UnitfulArray` inside a quaxlike Value so that unchanged
`jax.numpy` code drives these primitives.
"""

import builtins
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax import lax

from quaxlike.experimental.hijax import HiPrim, instantiate_zeros, ShapedArray

from ._type import UnitfulArray, UnitfulArraySpec, UnitfulArrayTy, units_of
from ._units import power, text, times, to_units, Units


def _array(ty: Any, x: Any) -> Any:
    return x.array if isinstance(ty, UnitfulArrayTy) else x


def _cotangent_for(ty: Any, ct: Any) -> Any:
    """A cotangent of the output, summed and typed for an input of type `ty`."""
    if jax.typeof(ct).shape != ty.shape:
        if ty.shape != ():
            raise NotImplementedError(
                f"UnitfulArray: no transpose for an operand of shape {ty.shape} "
                f"broadcast to {jax.typeof(ct).shape}; only scalars broadcast implicitly."
            )
        ct = sum(ct)
    return ct if isinstance(ty, UnitfulArrayTy) else unwrap(ct)


def _elementwise_type(x_ty: Any, y_ty: Any, units: Units) -> "UnitfulArrayTy":
    if x_ty.shape != y_ty.shape and () not in (x_ty.shape, y_ty.shape):
        raise TypeError(
            f"UnitfulArray: cannot combine shapes {x_ty.shape} and {y_ty.shape}: only "
            "a scalar broadcasts implicitly; use broadcast_in_dim."
        )
    shape = x_ty.shape or y_ty.shape
    return UnitfulArrayTy(shape, jnp.promote_types(x_ty.dtype, y_ty.dtype), units)


def _leading(size: int, args: Sequence[Any], dims: Sequence[Any]):
    """The batch rule's operands, each with its batch axis first (an unbatched one
    broadcast to `size`), and the output spec; `None` when nothing is batched."""
    if all(d is None for d in dims):
        return list(args), None
    out = []
    for x, d in zip(args, dims, strict=True):
        ty = jax.typeof(x)
        if d is None:
            shape = (size, *ty.shape)
            kept = tuple(range(1, len(shape)))
            x = (
                broadcast_in_dim(x, shape, kept)
                if isinstance(ty, UnitfulArrayTy)
                else jnp.broadcast_to(x, shape)
            )
        elif isinstance(d, int) and d != 0:
            x = jnp.moveaxis(x, d, 0)
        out.append(x)
    # A scalar operand broadcasts against the others; batched, it is (size,) and
    # would not, so it is broadcast to the full batched shape here.
    full = max((jax.typeof(x).shape for x in out), key=len)
    for i, x in enumerate(out):
        ty = jax.typeof(x)
        if ty.shape != full:
            out[i] = (
                broadcast_in_dim(x, full, (0,))
                if isinstance(ty, UnitfulArrayTy)
                else lax.broadcast_in_dim(x, full, (0,))
            )
    return out, UnitfulArraySpec()


class _Wrap(HiPrim):
    def __init__(self, x_ty, units: Units):
        self.in_avals = (x_ty,)
        self.out_aval = UnitfulArrayTy(x_ty.shape, x_ty.dtype, units)
        self.params = {"units": units}
        super().__init__()

    def expand(self, x):
        return UnitfulArray(x, self.units)

    def jvp(self, primals, tangents):
        return self(*primals), wrap(instantiate_zeros(tangents[0]), self.units)

    def vjp_fwd(self, nonzeros, x):
        return self(x), None

    def vjp_bwd_retval(self, residual, g):
        return (unwrap(instantiate_zeros(g)),)  # a plain input: plain cotangent

    def batch(self, axis_data, args, dims):
        (x,), (d,) = args, dims
        if d is None:
            return self(x), None
        return wrap(jnp.moveaxis(x, d, 0), self.units), UnitfulArraySpec()


class _Unwrap(HiPrim):
    def __init__(self, q_ty):
        self.in_avals = (q_ty,)
        self.out_aval = ShapedArray(q_ty.shape, q_ty.dtype)
        self.params = {}
        super().__init__()

    def expand(self, q):
        return q.array

    def jvp(self, primals, tangents):
        return self(*primals), unwrap(instantiate_zeros(tangents[0]))

    def vjp_fwd(self, nonzeros, q):
        return self(q), None

    def vjp_bwd_retval(self, residual, g):
        # d(number)/d(q) is measured per unit of q.
        return (wrap(instantiate_zeros(g), power(self.in_avals[0].units, -1)),)

    def batch(self, axis_data, args, dims):
        # A mapped UnitfulArray is mapped over its leading axis (its spec says
        # so); the plain array out is mapped over the same axis, by number.
        return self(*args), (None if dims[0] is None else 0)


class _Add(HiPrim):
    def __init__(self, x_ty, y_ty):
        if units_of(x_ty) != units_of(y_ty):
            raise TypeError(
                f"UnitfulArray: cannot add {text(units_of(x_ty))!r} and "
                f"{text(units_of(y_ty))!r}: the units differ. Convert one operand first."
            )
        self.in_avals = (x_ty, y_ty)
        self.out_aval = _elementwise_type(x_ty, y_ty, units_of(x_ty))
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        x_ty, y_ty = self.in_avals
        return UnitfulArray(_array(x_ty, x) + _array(y_ty, y), self.out_aval.units)

    def jvp(self, primals, tangents):
        return self(*primals), add(*map(instantiate_zeros, tangents))

    def vjp_fwd(self, nonzeros, x, y):
        return self(x, y), None

    def vjp_bwd_retval(self, residual, g):
        g = instantiate_zeros(g)
        return tuple(_cotangent_for(ty, g) for ty in self.in_avals)

    def batch(self, axis_data, args, dims):
        args, spec = _leading(axis_data.size, args, dims)
        return add(*args), spec


class _Mul(HiPrim):
    def __init__(self, x_ty, y_ty):
        self.in_avals = (x_ty, y_ty)
        units = times(units_of(x_ty), units_of(y_ty))
        self.out_aval = _elementwise_type(x_ty, y_ty, units)
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        x_ty, y_ty = self.in_avals
        return UnitfulArray(_array(x_ty, x) * _array(y_ty, y), self.out_aval.units)

    def jvp(self, primals, tangents):
        (x, y), (tx, ty) = primals, map(instantiate_zeros, tangents)
        return self(x, y), add(mul(tx, y), mul(x, ty))

    def vjp_fwd(self, nonzeros, x, y):
        return self(x, y), (x, y)

    def vjp_bwd_retval(self, residual, g):
        (x, y), g = residual, instantiate_zeros(g)
        x_ty, y_ty = self.in_avals
        # g is per (x y): g y is per x and g x is per y, as the input types ask.
        return _cotangent_for(x_ty, mul(g, y)), _cotangent_for(y_ty, mul(x, g))

    def batch(self, axis_data, args, dims):
        args, spec = _leading(axis_data.size, args, dims)
        return mul(*args), spec


class _IntPow(HiPrim):
    def __init__(self, q_ty, y: int):
        self.in_avals = (q_ty,)
        self.out_aval = UnitfulArrayTy(q_ty.shape, q_ty.dtype, power(q_ty.units, y))
        self.params = {"y": y}
        super().__init__()

    def expand(self, q):
        return UnitfulArray(lax.integer_pow(q.array, self.y), self.out_aval.units)

    def _chain(self, q, other):
        # y q^(y-1) * other: a tangent (units u^y) or a cotangent (units u^-1).
        scale = wrap(jnp.asarray(self.y, jax.typeof(other).dtype), ())
        return mul(scale, mul(int_pow(q, self.y - 1), other))

    def jvp(self, primals, tangents):
        (q,), (t,) = primals, tangents
        return self(q), self._chain(q, instantiate_zeros(t))

    def vjp_fwd(self, nonzeros, q):
        return self(q), q

    def vjp_bwd_retval(self, q, g):
        return (self._chain(q, instantiate_zeros(g)),)

    def batch(self, axis_data, args, dims):
        (q,), spec = _leading(axis_data.size, args, dims)
        return int_pow(q, self.y), spec


class _Sum(HiPrim):
    def __init__(self, q_ty, axes: tuple[int, ...]):
        self.in_avals = (q_ty,)
        kept = tuple(n for i, n in enumerate(q_ty.shape) if i not in axes)
        self.out_aval = UnitfulArrayTy(kept, q_ty.dtype, q_ty.units)
        self.params = {"axes": axes}
        super().__init__()

    def expand(self, q):
        return UnitfulArray(jnp.sum(q.array, axis=self.axes), q.units)

    def jvp(self, primals, tangents):
        return self(*primals), sum(instantiate_zeros(tangents[0]), self.axes)

    def vjp_fwd(self, nonzeros, q):
        return self(q), None

    def vjp_bwd_retval(self, residual, g):
        (q_ty,) = self.in_avals
        kept = tuple(i for i in range(len(q_ty.shape)) if i not in self.axes)
        return (broadcast_in_dim(instantiate_zeros(g), q_ty.shape, kept),)

    def batch(self, axis_data, args, dims):
        (q,), spec = _leading(axis_data.size, args, dims)
        if spec is None:
            return self(q), None
        return sum(q, tuple(a + 1 for a in self.axes)), spec


class _BroadcastInDim(HiPrim):
    def __init__(self, q_ty, shape: tuple[int, ...], dims: tuple[int, ...]):
        self.in_avals = (q_ty,)
        self.out_aval = UnitfulArrayTy(shape, q_ty.dtype, q_ty.units)
        self.params = {"shape": shape, "broadcast_dimensions": dims}
        super().__init__()

    def expand(self, q):
        out = lax.broadcast_in_dim(q.array, self.shape, self.broadcast_dimensions)
        return UnitfulArray(out, q.units)

    def jvp(self, primals, tangents):
        t = instantiate_zeros(tangents[0])
        return self(*primals), broadcast_in_dim(t, self.shape, self.broadcast_dimensions)

    def vjp_fwd(self, nonzeros, q):
        return self(q), None

    def vjp_bwd_retval(self, residual, g):
        (q_ty,) = self.in_avals
        dims = self.broadcast_dimensions
        if any(n != self.shape[d] for d, n in zip(dims, q_ty.shape, strict=True)):
            raise NotImplementedError(
                f"UnitfulArray: no transpose for a broadcast of {q_ty.shape} to "
                f"{self.shape} that stretches a size-1 axis."
            )
        new = tuple(i for i in range(len(self.shape)) if i not in dims)
        return (sum(instantiate_zeros(g), new),)

    def batch(self, axis_data, args, dims):
        (q,), spec = _leading(axis_data.size, args, dims)
        if spec is None:
            return self(q), None
        shape = (axis_data.size, *self.shape)
        return broadcast_in_dim(q, shape, (0, *(d + 1 for d in self.broadcast_dimensions))), spec


# Each primitive's types are fixed when it is made, so each function makes one
# from its operands' types and applies it.


def wrap(x: Any, units: Any = (), /) -> UnitfulArray:
    """Attach units to an array, as a `UnitfulArray`.

    **Arguments:**

    - `x`: an array or scalar.
    - `units`: a `Dimension`, a `{Dimension: exponent}` dict or a `Units` tuple.

    **Returns:**

    The `UnitfulArray`.

    !!! example

        ```python
        from quaxlike.units import meters, seconds

        v = wrap(jnp.array([3.0]), {meters: 1, seconds: -1})
        assert str(jax.typeof(v)) == "u[1]{m s^-1}"
        ```
    """
    x = jnp.asarray(x)
    return _Wrap(jax.typeof(x), to_units(units))(x)


def unwrap(q: Any, /) -> Any:
    """The array of a `UnitfulArray`, without its units.

    **Arguments:**

    - `q`: a `UnitfulArray`.

    **Returns:**

    The plain array.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert jnp.array_equal(unwrap(q), jnp.array([1.0, 2.0]))
        ```
    """
    return _Unwrap(jax.typeof(q))(q)


def add(x: Any, y: Any, /) -> UnitfulArray:
    """`x + y` for operands of the same units (`TypeError` otherwise).

    **Arguments:**

    - `x`, `y`: `UnitfulArray`s of the same units (or plain arrays, if both are dimensionless).

    **Returns:**

    A `UnitfulArray` in those units.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert jnp.array_equal(unwrap(add(q, q)), jnp.array([2.0, 4.0]))
        ```
    """
    return _Add(jax.typeof(x), jax.typeof(y))(x, y)


def _vspace_add(ty: UnitfulArrayTy, x: Any, y: Any) -> UnitfulArray:
    """Two tangents of one type add with the `add` primitive (JAX's vector-space
    addition for a high-level type, used when gradients are summed)."""
    del ty
    return add(x, y)


# The type comes first (`_type`), the primitives on it here; the type's tangent
# addition is one of those primitives, so it is attached once both exist.
UnitfulArrayTy.vspace_add = _vspace_add  # type: ignore[method-assign]


def mul(x: Any, y: Any, /) -> UnitfulArray:
    """`x * y`; either may be a plain array (dimensionless).

    **Arguments:**

    - `x`, `y`: `UnitfulArray`s or plain arrays; a scalar broadcasts.

    **Returns:**

    A `UnitfulArray` whose units are the product.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert jax.typeof(mul(q, q)).units == ((meters, 2),)
        ```
    """
    return _Mul(jax.typeof(x), jax.typeof(y))(x, y)


def int_pow(q: Any, y: int, /) -> UnitfulArray:
    """`q ** y` for a static integer `y`, units included.

    **Arguments:**

    - `q`: a `UnitfulArray`.
    - `y`: a Python integer.

    **Returns:**

    A `UnitfulArray` in the units to the power `y`.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([2.0]), meters)
        assert jax.typeof(int_pow(q, 3)).units == ((meters, 3),)
        ```
    """
    return _IntPow(jax.typeof(q), int(y))(q)


def sum(q: Any, axes: Sequence[int] | None = None, /) -> UnitfulArray:  # noqa: A001
    """The sum over `axes` (every axis when `None`); the units are kept.

    **Arguments:**

    - `q`: a `UnitfulArray`.
    - `axes`: the axes to sum over, or `None` for all.

    **Returns:**

    A `UnitfulArray` in the same units.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert unwrap(sum(q)) == 3.0
        ```
    """
    if axes is None:
        axes = builtins.range(len(jax.typeof(q).shape))
    return _Sum(jax.typeof(q), tuple(axes))(q)


def broadcast_in_dim(q: Any, shape: Sequence[int], dims: Sequence[int], /) -> UnitfulArray:
    """`lax.broadcast_in_dim` for a `UnitfulArray`; the units are kept.

    **Arguments:**

    - `q`: a `UnitfulArray`.
    - `shape`: the shape of the result.
    - `dims`: for each axis of `q`, the axis of the result it becomes.

    **Returns:**

    A `UnitfulArray` of that shape, in the same units.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert jax.typeof(broadcast_in_dim(q, (3, 2), (1,))).shape == (3, 2)
        ```
    """
    return _BroadcastInDim(jax.typeof(q), tuple(shape), tuple(dims))(q)
