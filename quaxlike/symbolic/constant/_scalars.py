"""Scalar arithmetic for static Constants, at trace time.

A static scalar is a 0-d NumPy array of the Constant's dtype. Primitives whose
result NumPy computes exactly as XLA does (correctly rounded IEEE arithmetic,
wrap-around integer arithmetic, comparisons, bitwise operations, conversions) are
computed with NumPy, which costs nothing; cases where the two differ (integer
division by zero, out-of-range shifts, float-to-int overflow, signed zeros in
`max`, subnormal floats, which XLA may flush to zero) and every other primitive (transcendental functions, `pow`, ...) are
computed by JAX itself, eagerly, under `jax.ensure_compile_time_eval`. Either way
nothing is added to a traced program, and the result is exactly what JAX gives.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core.primitives as jex_primitives
import jax.numpy as jnp
import numpy as np
from jax import lax


def _is_float(x: np.ndarray) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.floating))  # bfloat16 and float8 too


def _is_int(x: np.ndarray) -> bool:
    return bool(np.issubdtype(x.dtype, np.integer))  # not int4: NumPy has no int4


def _is_real(x: np.ndarray) -> bool:
    return _is_int(x) or _is_float(x) or x.dtype == np.bool_


def _exact_binary(np_fn):
    # +, -, * of reals: correctly rounded (floats; bfloat16 and float16 go
    # through float32, which is exact for these) or wrap-around (integers).
    def rule(x, y, **params):
        if _is_real(x) and _is_real(y) and x.dtype != np.bool_:
            return np_fn(x, y)
        return None

    return rule


def _div(x, y, **params):
    if _is_float(x):
        return np.divide(x, y)
    if _is_int(x):
        # XLA defines x / 0 and INT_MIN / -1 its own way, and |INT_MIN| overflows.
        if y == 0 or _is_signed_min(x) or _is_signed_min(y):
            return None
        quotient = np.abs(x) // np.abs(y)  # truncation towards zero, like XLA
        return quotient if (x < 0) == (y < 0) else -quotient
    return None


def _rem(x, y, **params):
    if _is_float(x) or (_is_int(x) and y != 0 and not _is_signed_min(x)):
        return np.fmod(x, y)  # C semantics: the sign of the dividend, like XLA
    return None


def _is_subnormal(x: np.ndarray) -> bool:
    if not (_is_float(x) or x.dtype.kind == "c"):
        return False
    tiny = jnp.finfo(x.dtype).smallest_normal
    with np.errstate(all="ignore"):
        magnitudes = [np.abs(np.real(x)), np.abs(np.imag(x))]
        return any(bool(0 < m < tiny) for m in magnitudes)


def _is_signed_min(x: np.ndarray) -> bool:
    return bool(np.issubdtype(x.dtype, np.signedinteger) and x == np.iinfo(x.dtype).min)


def _max_min(np_fn):
    def rule(x, y, **params):
        if not _is_real(x) or (x == y and x.tobytes() != y.tobytes()):
            return None  # complex order, or max(-0.0, 0.0): leave it to XLA
        return np_fn(x, y)

    return rule


def _shift(kind):
    def rule(x, y, **params):
        bits = x.dtype.itemsize * 8
        if not _is_int(x) or not 0 <= y < bits:
            return None
        if kind == "arithmetic" and not np.issubdtype(x.dtype, np.signedinteger):
            return None
        if kind == "left":
            return np.left_shift(x, y)
        if kind == "arithmetic":
            return np.right_shift(x, y)
        unsigned = np.dtype(f"uint{bits}")
        return np.right_shift(x.view(unsigned), y.astype(unsigned)).view(x.dtype)

    return rule


def _convert(x, *, new_dtype, **params):
    new_dtype = np.dtype(new_dtype)
    if x.dtype.kind == "c" and new_dtype.kind != "c":
        return None
    if _is_float(x) and np.issubdtype(new_dtype, np.integer):
        info = np.iinfo(new_dtype)
        if not (np.isfinite(x) and info.min <= x.astype(np.float64) <= info.max):
            return None  # NaN and overflow: XLA's saturation, not NumPy's
    return x.astype(new_dtype)


def _round(x, *, rounding_method, **params):
    if _is_float(x) and int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN):
        return np.rint(x)
    return None


def _integer_pow(x, *, y, **params):
    if _is_int(x) and y >= 0:
        return np.power(x, y)  # wraps; the order of the products does not matter
    if y in (0, 1, 2):
        return np.ones_like(x) if y == 0 else x if y == 1 else x * x
    return None  # floats round differently depending on the order of products


def _sqrt(x, **params):
    return np.sqrt(x) if _is_float(x) else None


def _complex(x, y, **params):
    out = np.empty((), np.result_type(x.dtype, np.complex64))
    out.real, out.imag = x, y
    return out


def _unary(np_fn, kinds=("real",)) -> Callable:
    def rule(x, **params):
        if "real" in kinds and not _is_real(x):
            return None
        return np_fn(x)

    return rule


def _plain(np_fn) -> Callable:
    return lambda *xs, **params: np_fn(*xs)


_NUMPY: dict[Any, Callable] = {
    lax.add_p: _exact_binary(np.add),
    jex_primitives.add_jaxvals_p: _exact_binary(np.add),
    lax.sub_p: _exact_binary(np.subtract),
    lax.mul_p: _exact_binary(np.multiply),
    lax.div_p: _div,
    lax.rem_p: _rem,
    lax.max_p: _max_min(np.maximum),
    lax.min_p: _max_min(np.minimum),
    lax.and_p: _plain(np.bitwise_and),
    lax.or_p: _plain(np.bitwise_or),
    lax.xor_p: _plain(np.bitwise_xor),
    lax.not_p: _unary(np.invert),
    lax.eq_p: _plain(np.equal),
    lax.ne_p: _plain(np.not_equal),
    lax.lt_p: _plain(np.less),
    lax.le_p: _plain(np.less_equal),
    lax.gt_p: _plain(np.greater),
    lax.ge_p: _plain(np.greater_equal),
    lax.shift_left_p: _shift("left"),
    lax.shift_right_arithmetic_p: _shift("arithmetic"),
    lax.shift_right_logical_p: _shift("logical"),
    lax.neg_p: _unary(np.negative, kinds=()),
    lax.abs_p: _unary(np.abs),
    lax.floor_p: _unary(np.floor),
    lax.ceil_p: _unary(np.ceil),
    lax.is_finite_p: _unary(np.isfinite),
    lax.square_p: _unary(lambda x: x * x),
    lax.real_p: _unary(np.real, kinds=()),
    lax.imag_p: _unary(np.imag, kinds=()),
    lax.conj_p: _unary(np.conj, kinds=()),
    lax.copy_p: _unary(lambda x: x, kinds=()),
    jex_primitives.stop_gradient_p: _unary(lambda x: x, kinds=()),
    lax.sqrt_p: _sqrt,
    lax.round_p: _round,
    lax.integer_pow_p: _integer_pow,
    lax.convert_element_type_p: _convert,
    lax.complex_p: _complex,
    lax.select_n_p: lambda predicate, *cases, **params: cases[int(predicate)],
}


def numpy_bind(primitive, scalars: list[np.ndarray], params: dict[str, Any]) -> np.ndarray | None:
    """`primitive.bind(*scalars, **params)` computed with NumPy, or `None` where
    NumPy might not agree with XLA bit for bit."""
    numpy_fn = _NUMPY.get(primitive)
    if numpy_fn is None:
        return None
    with np.errstate(all="ignore"):  # overflow to inf or wrap-around is intended
        out = numpy_fn(*scalars, **params)
    if out is None:
        return None
    out = np.asarray(out)
    # XLA may flush subnormal floats to zero (it does on CPU); NumPy does not.
    if any(map(_is_subnormal, [*scalars, out])):
        return None
    return out


def static_bind(
    primitive, scalars: list[np.ndarray], params: dict[str, Any], fallback: Callable | None = None
) -> np.ndarray:
    """`primitive.bind(*scalars, **params)` for 0-d NumPy arrays, at trace time.

    `fallback`, when given, is the public function to call instead of binding
    `primitive` where NumPy is not used (it fills in the primitive's params).
    """
    out = numpy_bind(primitive, scalars, params)
    if out is not None:
        return out
    with jax.ensure_compile_time_eval():
        if fallback is not None:
            return np.asarray(fallback(*scalars))
        return np.asarray(primitive.bind(*scalars, **params))
