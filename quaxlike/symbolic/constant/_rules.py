"""Rules for `Constant`.

Three kinds of rule:

- elementwise primitives whose operands are all Constants or scalars give a
  Constant, its scalar computed once (at trace time when every operand is static);
- shape-only primitives (broadcast, reshape, slice, ...) and reductions keep the
  scalar and change the shape, in closed form;
- an elementwise primitive between a Constant and a dense array is simplified
  where the scalar is an identity or annihilator (`x * 1`, `x + 0`, `x * 0`) and
  otherwise applied with the Constant as a rank-0 operand, so it never becomes a
  full array; `dot_general` with a dense array becomes a sum over the contracted
  axes, scaled.

Static scalars are computed at trace time (see `_scalars.py`: with NumPy where it
agrees with XLA exactly, else by JAX itself), so they follow JAX's dtype semantics
exactly and add nothing to a traced program.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import jax
import jax.core
import jax.extend.core.primitives as jex_primitives
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import output_aval, ShapedArray, TRANSCENDENTAL_PRIMITIVES

from ._scalars import static_bind
from ._value import _default_dtype, Constant


_Operand = Constant | ArrayLike
_Any = ArrayLike | quaxlike.ArrayValue

# (is_static, scalar): a 0-d NumPy array when static, a JAX scalar when traced.
_Parts = tuple[bool, Any]


# --- helpers --------------------------------------------------------------------


@overload
def _scalar_parts(x: Constant) -> _Parts: ...
@overload
def _scalar_parts(x: Any) -> _Parts | None: ...
def _scalar_parts(x: Any) -> _Parts | None:
    """For a Constant or a rank-0 array: whether it is known at trace time, and
    its scalar. `None` for anything else."""
    if isinstance(x, Constant):
        return x.is_static, x.scalar()
    if isinstance(x, quaxlike.Value) or np.ndim(x) != 0:
        return None
    if isinstance(x, jax.core.Tracer):
        return False, x
    return True, np.asarray(x, dtype=_default_dtype(x))


def _apply(primitive, parts: Sequence[_Parts], **params) -> _Parts:
    """`primitive` applied to the scalars of `parts`: at trace time when all are
    static (nothing is staged out), else as one ordinary scalar operation."""
    scalars = [scalar for _, scalar in parts]
    if all(static for static, _ in parts):
        return True, static_bind(primitive, scalars, params)
    return False, primitive.bind(*scalars, **params)


def _apply_fn(fn: Callable, primitive, parts: Sequence[_Parts], **kwargs) -> _Parts:
    """Like `_apply`, for the public function `fn` that binds `primitive` (so that
    JAX fills in the primitive's params)."""
    scalars = [scalar for _, scalar in parts]
    if all(static for static, _ in parts):
        fallback = lambda *xs: fn(*xs, **kwargs)  # noqa: E731
        return True, static_bind(primitive, scalars, kwargs, fallback)
    return False, fn(*scalars, **kwargs)


def _constant(parts: _Parts, aval: ShapedArray) -> Constant:
    static, scalar = parts
    if static:
        return Constant(np.asarray(scalar, dtype=aval.dtype), aval.shape, aval.dtype, static=True)
    return Constant(scalar, aval.shape, aval.dtype, static=False)


def _filled(value, aval: ShapedArray) -> Constant:
    return Constant(np.asarray(value, dtype=aval.dtype), aval.shape, aval.dtype, static=True)


def _with_shape(x: Constant, aval: ShapedArray) -> Constant:
    return Constant(x.scalar(), aval.shape, aval.dtype, static=x.is_static)


def _converted(parts: _Parts, dtype) -> _Parts:
    if parts[1].dtype == dtype:
        return parts
    return _apply_fn(
        lax.convert_element_type, lax.convert_element_type_p, [parts], new_dtype=np.dtype(dtype)
    )


def _same_scalar(a: _Parts, b: _Parts) -> bool:
    """Whether two scalars are known at trace time to be equal (bit for bit)."""
    (a_static, a_scalar), (b_static, b_scalar) = a, b
    if a_static and b_static:
        return a_scalar.dtype == b_scalar.dtype and a_scalar.tobytes() == b_scalar.tobytes()
    return a_scalar is b_scalar


def _as_output(x, aval: ShapedArray):
    """`x` broadcast and converted to `aval` (a no-op when it already matches)."""
    if isinstance(x, Constant):
        return x if (x.shape, x.dtype) == (aval.shape, aval.dtype) else _with_shape(x, aval)
    return lax.convert_element_type(jnp.broadcast_to(x, aval.shape), aval.dtype)


def _static_scalar(parts: _Parts | None):
    return parts[1] if parts is not None and parts[0] else None


def _all_ones(dtype) -> np.ndarray:
    return np.asarray(np.invert(np.zeros((), dtype)))


# --- elementwise primitives --------------------------------------------------------
#
# Each simplification gets the operands, their `_scalar_parts` (at least one is
# `None`: a dense array) and the output aval, and returns the result or
# `NotImplemented`.


def _simplify_add(args, parts, aval):
    for i in (0, 1):
        value = _static_scalar(parts[i])
        if value is not None and value == 0:
            return _as_output(args[1 - i], aval)
    return NotImplemented


def _simplify_sub(args, parts, aval):
    x, y = args
    y_value, x_value = _static_scalar(parts[1]), _static_scalar(parts[0])
    if y_value is not None and y_value == 0:
        return _as_output(x, aval)
    if x_value is not None and x_value == 0:
        return _as_output(lax.neg(y), aval)
    return NotImplemented


def _simplify_mul(args, parts, aval):
    for i in (0, 1):
        value = _static_scalar(parts[i])
        if value is None:
            continue
        if value == 1:
            return _as_output(args[1 - i], aval)
        if value == 0:  # like JAX's symbolic zeros: 0 * nan is 0 here
            return _filled(0, aval)
    return NotImplemented


def _simplify_div(args, parts, aval):
    value = _static_scalar(parts[1])
    if value is not None and value == 1:
        return _as_output(args[0], aval)
    return NotImplemented


def _simplify_pow(args, parts, aval):
    value = _static_scalar(parts[1])
    if value is not None and value == 1:
        return _as_output(args[0], aval)
    if value is not None and value == 0:  # x ** 0 == 1, even for x = 0 or nan
        return _filled(1, aval)
    return NotImplemented


def _simplify_and(args, parts, aval):
    for i in (0, 1):
        value = _static_scalar(parts[i])
        if value is None:
            continue
        if value == 0:
            return _filled(0, aval)
        if value == _all_ones(aval.dtype):
            return _as_output(args[1 - i], aval)
    return NotImplemented


def _simplify_or(args, parts, aval):
    for i in (0, 1):
        value = _static_scalar(parts[i])
        if value is None:
            continue
        if value == 0:
            return _as_output(args[1 - i], aval)
        if value == _all_ones(aval.dtype):
            return _filled(_all_ones(aval.dtype), aval)
    return NotImplemented


def _simplify_xor(args, parts, aval):
    for i in (0, 1):
        value = _static_scalar(parts[i])
        if value is not None and value == 0:
            return _as_output(args[1 - i], aval)
    return NotImplemented


def _simplify_select_n(args, parts, aval):
    predicate, *cases = args
    index = _static_scalar(parts[0])
    if index is not None:
        return _as_output(cases[int(index)], aval)
    case_parts = parts[1:]
    if all(p is not None for p in case_parts) and all(
        _same_scalar(case_parts[0], p) for p in case_parts[1:]
    ):
        return _constant(case_parts[0], aval)
    if parts[0] is not None:
        # A scalar predicate picks one whole case: only the cases need to be arrays.
        # (A Constant picked by it is part of the output, so it is built in full.)
        arrays = [
            lax.full(c.shape, c.scalar(), c.dtype) if isinstance(c, Constant) else c for c in cases
        ]
        return lax.select_n(parts[0][1], *arrays)
    return NotImplemented


_SIMPLIFICATIONS: dict[Any, Callable] = {
    lax.add_p: _simplify_add,
    lax.sub_p: _simplify_sub,
    lax.mul_p: _simplify_mul,
    lax.div_p: _simplify_div,
    lax.pow_p: _simplify_pow,
    lax.and_p: _simplify_and,
    lax.or_p: _simplify_or,
    lax.xor_p: _simplify_xor,
    lax.select_n_p: _simplify_select_n,
}

_UNARY = [
    lax.neg_p,
    lax.sign_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.is_finite_p,
    *TRANSCENDENTAL_PRIMITIVES,
    lax.real_p,
    lax.imag_p,
    lax.conj_p,
    lax.abs_p,
    lax.sqrt_p,
    lax.rsqrt_p,
    lax.cbrt_p,
    lax.square_p,
    lax.not_p,
    lax.integer_pow_p,
    lax.convert_element_type_p,
    lax.reduce_precision_p,
    lax.population_count_p,
    lax.clz_p,
    jex_primitives.stop_gradient_p,
]

# Binary primitives that accept a rank-0 operand next to an array (and broadcast
# it), so a Constant next to a dense array can be passed as its scalar.
_BINARY = [
    lax.add_p,
    lax.sub_p,
    lax.mul_p,
    lax.div_p,
    lax.rem_p,
    lax.pow_p,
    lax.max_p,
    lax.min_p,
    lax.atan2_p,
    lax.nextafter_p,
    lax.and_p,
    lax.or_p,
    lax.xor_p,
    lax.eq_p,
    lax.ne_p,
    lax.lt_p,
    lax.le_p,
    lax.gt_p,
    lax.ge_p,
    lax.shift_left_p,
    lax.shift_right_logical_p,
    lax.shift_right_arithmetic_p,
    lax.complex_p,
    lax.igamma_p,
    lax.igammac_p,
    lax.polygamma_p,
    lax.zeta_p,
]

# Elementwise primitives computed on scalars only when every operand is one.
_OTHER_ELEMENTWISE = [jex_primitives.add_jaxvals_p, lax.select_n_p, lax.clamp_p]


def _make_elementwise_rule(primitive, scalar_operands: bool):
    simplify = _SIMPLIFICATIONS.get(primitive)

    def rule(*args: _Operand, **params):
        parts = [_scalar_parts(a) for a in args]
        aval = output_aval(primitive, args, params)
        if all(p is not None for p in parts):
            scalars = _apply(primitive, cast("list[_Parts]", parts), **params)
            if aval.shape == () and not all(isinstance(a, Constant) for a in args):
                # A dense scalar took part: a rank-0 Constant would be no cheaper
                # than the scalar itself, and would turn a result like
                # `jnp.sum(x) + jnp.sum(c)` into a Value.
                return jnp.asarray(scalars[1])
            return _constant(scalars, aval)
        if simplify is not None:
            out = simplify(args, parts, aval)
            if out is not NotImplemented:
                return out
        if not scalar_operands:
            return NotImplemented
        # A Constant next to a dense array: pass its scalar as a rank-0 operand.
        operands = [a.scalar() if isinstance(a, Constant) else a for a in args]
        out = primitive.bind(*operands, **params)
        if out.shape != aval.shape:
            # The dense operand had size-1 axes that the Constant's shape
            # broadcast (`jnp.outer`: `(n, 1) * (1, m)`): the scalar did not.
            out = lax.broadcast_in_dim(out, aval.shape, tuple(range(out.ndim)))
        return out

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_constant"
    return rule


for _primitive in _UNARY + _OTHER_ELEMENTWISE + _BINARY:
    quaxlike.register(_primitive)(
        _make_elementwise_rule(_primitive, scalar_operands=_primitive in _BINARY)
    )


# --- shapes and indexing ------------------------------------------------------------

# Primitives that rearrange or select entries: the scalar stays, the shape changes.
_SHAPE_ONLY = [
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.rev_p,
    lax.slice_p,
    lax.copy_p,
    lax.cummax_p,
    lax.cummin_p,
]


def _make_shape_rule(primitive):
    def rule(x: Constant, **params) -> Constant:
        return _with_shape(x, output_aval(primitive, (x,), params))

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_constant"
    return rule


for _primitive in _SHAPE_ONLY:
    quaxlike.register(_primitive)(_make_shape_rule(_primitive))


@quaxlike.register(lax.split_p)
def split_p_constant(x: Constant, **params) -> list[Constant]:
    return [_with_shape(x, aval) for aval in output_aval(lax.split_p, (x,), params)]


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_constant(x: Constant, *indices: _Any, **params) -> Constant:
    return _with_shape(x, output_aval(lax.dynamic_slice_p, (x, *indices), params))


@quaxlike.register(lax.dynamic_update_slice_p)
def dynamic_update_slice_p_constant_constant(
    x: Constant, update: Constant, *indices: _Any, **params
):
    if not _same_scalar(_scalar_parts(x), _scalar_parts(update)):
        return NotImplemented
    return x


_IN_BOUNDS_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@quaxlike.register(lax.gather_p)
def gather_p_constant_any(x: Constant, indices: _Any, *, mode, fill_value, **params):
    # Out-of-bounds indices of a filling gather give `fill_value` (NaN by default
    # for floats), so the result is constant only if that is the Constant's value.
    if mode not in _IN_BOUNDS_MODES and not (
        mode == lax.GatherScatterMode.FILL_OR_DROP
        and fill_value is not None
        and x.is_static
        and x.scalar() == fill_value
    ):
        return NotImplemented
    params = dict(params, mode=mode, fill_value=fill_value)
    return _with_shape(x, output_aval(lax.gather_p, (x, indices), params))


@quaxlike.register(lax.concatenate_p)
def concatenate_p_constants(*xs: Constant, **params):
    first = _scalar_parts(xs[0])
    if not all(_same_scalar(first, _scalar_parts(x)) for x in xs[1:]):
        return NotImplemented
    return _with_shape(xs[0], output_aval(lax.concatenate_p, xs, params))


@quaxlike.register(lax.pad_p)
def pad_p_constant_any(x: Constant, padding_value: _Operand, **params):
    padding = _scalar_parts(padding_value)
    if padding is None or not _same_scalar(_scalar_parts(x), padding):
        return NotImplemented
    return _with_shape(x, output_aval(lax.pad_p, (x, padding_value), params))


# --- reductions -------------------------------------------------------------------


def _count(x: Constant, axes) -> int:
    return math.prod(x.shape[a] for a in axes)


@quaxlike.register(lax.reduce_sum_p)
def reduce_sum_p_constant(x: Constant, *, axes, **params) -> Constant:
    aval = output_aval(lax.reduce_sum_p, (x,), dict(params, axes=axes))
    # `count` converted as JAX would (wrapping for small integer types), so the
    # product equals the sum up to floating-point rounding.
    count = _converted((True, np.asarray(_count(x, axes))), x.dtype)
    return _constant(_apply_fn(lax.mul, lax.mul_p, [_scalar_parts(x), count]), aval)


@quaxlike.register(lax.reduce_prod_p)
def reduce_prod_p_constant(x: Constant, *, axes, **params) -> Constant:
    aval = output_aval(lax.reduce_prod_p, (x,), dict(params, axes=axes))
    parts = [_scalar_parts(x)]
    return _constant(_apply_fn(lax.integer_pow, lax.integer_pow_p, parts, y=_count(x, axes)), aval)


def _make_idempotent_reduction_rule(primitive):
    # max(c, c, ...) == c: the scalar stays, unless nothing is reduced (then the
    # result is the reduction's identity: materialise).
    def rule(x: Constant, *, axes, **params):
        if _count(x, axes) == 0:
            return NotImplemented
        return _with_shape(x, output_aval(primitive, (x,), dict(params, axes=axes)))

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_constant"
    return rule


for _primitive in [lax.reduce_max_p, lax.reduce_min_p, lax.reduce_and_p, lax.reduce_or_p]:
    quaxlike.register(_primitive)(_make_idempotent_reduction_rule(_primitive))


@quaxlike.register(lax.reduce_xor_p)
def reduce_xor_p_constant(x: Constant, *, axes, **params) -> Constant:
    aval = output_aval(lax.reduce_xor_p, (x,), dict(params, axes=axes))
    if _count(x, axes) % 2 == 1:
        return _with_shape(x, aval)
    return _filled(0, aval)  # c ^ c == 0


@quaxlike.register([lax.argmax_p, lax.argmin_p])
def argmax_p_constant(x: Constant, *, axes, **params):
    if _count(x, axes) == 0:
        return NotImplemented
    aval = output_aval(lax.argmax_p, (x,), dict(params, axes=axes))
    return _filled(0, aval)  # every entry ties: the first index


# --- dot_general ------------------------------------------------------------------


def _sum_over(dense, axes, dtype):
    dense = lax.convert_element_type(dense, dtype)
    if not axes:
        return dense
    return lax.reduce(dense, np.zeros((), dtype), lax.add, tuple(axes))


@quaxlike.register(lax.dot_general_p)
def dot_general_p_constant(x: _Operand, y: _Operand, *, dimension_numbers, **params):
    params = dict(params, dimension_numbers=dimension_numbers)
    aval = output_aval(lax.dot_general_p, (x, y), params)
    dtype = aval.dtype
    if dtype == np.bool_:
        return NotImplemented
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    if isinstance(x, Constant) and isinstance(y, Constant):
        a, b = _converted(_scalar_parts(x), dtype), _converted(_scalar_parts(y), dtype)
        count = _converted((True, np.asarray(_count(x, x_contract))), dtype)
        product = _apply_fn(lax.mul, lax.mul_p, [a, b])
        return _constant(_apply_fn(lax.mul, lax.mul_p, [product, count]), aval)

    # One Constant c and one dense d: every output entry is c times a sum of d over
    # its contracted axes, broadcast along the Constant's free axes.
    if isinstance(x, Constant):
        constant, dense, contract, batch, dense_is_left = x, y, y_contract, y_batch, False
    else:
        constant, dense, contract, batch, dense_is_left = y, x, x_contract, x_batch, True
    # The rule runs only when an operand is a Constant, and two returned above.
    constant, dense = cast(Constant, constant), cast(ArrayLike, dense)
    scalar = _converted(_scalar_parts(constant), dtype)
    if scalar[0] and scalar[1] == 0:
        return _filled(0, aval)
    total = _sum_over(dense, contract, dtype)
    kept = [d for d in range(np.ndim(dense)) if d not in contract]
    order = list(batch) + [d for d in kept if d not in batch]
    permutation = tuple(kept.index(d) for d in order)
    if permutation != tuple(sorted(permutation)):
        total = lax.transpose(total, permutation)
    if not (scalar[0] and scalar[1] == 1):
        total = lax.mul(total, scalar[1])
    n_batch, n_free = len(batch), len(order) - len(batch)
    start = n_batch if dense_is_left else len(aval.shape) - n_free
    dimensions = (*range(n_batch), *range(start, start + n_free))
    return lax.broadcast_in_dim(total, aval.shape, dimensions)
