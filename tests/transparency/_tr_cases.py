"""The transparency cases: calls of `jax.numpy`, `jax.lax`, `jax.nn` and `jax.scipy`
with JAX-test-style arguments, each a `Case` whose array arguments the tests wrap in
`quaxlike.DenseArrayValue`.

Families are built by small generators (a function over a list of dtypes and
shapes); every family's first combination, and a deterministic 32nd of the rest
(by CRC-32 of the id), form the default sample; the others are marked slow.
"""

import dataclasses
import functools as ft
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
from _tr_inputs import (
    ALL,
    array,
    BOOL,
    COMPLEX,
    FLOATS,
    INEXACT,
    INTS,
    name_of,
    NUMBERS,
    SIGNED,
)
from jax import lax


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: `fn(*args)`, every argument an array (static arguments are bound
    into `fn`).

    Arguments are NumPy arrays; the tests turn them into JAX arrays when they run.

    - `xfail`: mode (`"eager"` or `"jit"`) -> the reason it is known to differ.
    - `sampled`: in the default run (else only with `--run-slow` or a slow shard).
    """

    name: str
    fn: Callable
    args: tuple
    xfail: dict = dataclasses.field(default_factory=dict)
    sampled: bool = True


CASES: list[Case] = []

_ITEM1 = "issue 25 item 1: an eager call needing a concrete value raises through quaxify"
_ITEM2 = "issue 25 item 2: unhashable Literal when a jitted body returns a constant"
_ITEM3 = "issue 25 item 3: eager result a rounding away from plain JAX's compiled jit body"


def _add(family: str, fn, args, *, suffix: str = "", xfail=None, first: bool = False):
    name = f"{family}-{suffix}" if suffix else family
    sampled = first or zlib.crc32(name.encode()) % 32 == 0
    CASES.append(Case(name, fn, tuple(args), dict(xfail or {}), sampled))


def _shape_id(*shapes) -> str:
    return "_".join("x".join(map(str, s)) if s else "s" for s in shapes)


def _family(family, fn, dtypes, shapes_list, *, kind="normal", xfail=None):
    """`fn` over every dtype and every tuple of argument shapes (one argument per
    shape, all of the dtype)."""
    first = True
    for dtype in dtypes:
        for shapes in shapes_list:
            args = [array(i, s, dtype, kind=kind) for i, s in enumerate(shapes)]
            suffix = f"{name_of(dtype)}-{_shape_id(*shapes)}"
            x = xfail(dtype) if callable(xfail) else xfail
            _add(family, fn, args, suffix=suffix, xfail=x, first=first)
            first = False


# --- elementwise --------------------------------------------------------------------

_UNARY_SHAPES = [((),), ((5,),), ((2, 3),), ((0,),), ((2, 0, 3),)]

_UNARY = {
    # name: (function, dtypes, input kind)
    "abs": (jnp.abs, SIGNED + INEXACT, "special"),
    "negative": (jnp.negative, SIGNED + INEXACT, "special"),
    "sign": (jnp.sign, SIGNED + INEXACT, "special"),
    "floor": (jnp.floor, FLOATS, "special"),
    "ceil": (jnp.ceil, FLOATS, "special"),
    "round": (jnp.round, FLOATS, "normal"),
    "trunc": (jnp.trunc, FLOATS, "special"),
    "sqrt": (jnp.sqrt, INEXACT, "positive"),
    "rsqrt": (lax.rsqrt, FLOATS, "positive"),
    "cbrt": (jnp.cbrt, FLOATS, "special"),
    "exp": (jnp.exp, INEXACT, "normal"),
    "exp2": (jnp.exp2, FLOATS, "normal"),
    "expm1": (jnp.expm1, FLOATS, "special"),
    "log": (jnp.log, INEXACT, "positive"),
    "log1p": (jnp.log1p, FLOATS, "positive"),
    "log2": (jnp.log2, FLOATS, "positive"),
    "log10": (jnp.log10, FLOATS, "positive"),
    "sin": (jnp.sin, INEXACT, "normal"),
    "cos": (jnp.cos, INEXACT, "normal"),
    "tan": (jnp.tan, FLOATS, "unit"),
    "arcsin": (jnp.arcsin, FLOATS, "unit"),
    "arccos": (jnp.arccos, FLOATS, "unit"),
    "arctan": (jnp.arctan, INEXACT, "normal"),
    "sinh": (jnp.sinh, FLOATS, "unit"),
    "cosh": (jnp.cosh, FLOATS, "unit"),
    "tanh": (jnp.tanh, INEXACT, "normal"),
    "arcsinh": (jnp.arcsinh, FLOATS, "normal"),
    "arctanh": (jnp.arctanh, FLOATS, "unit"),
    "reciprocal": (jnp.reciprocal, INEXACT, "positive"),
    "square": (jnp.square, NUMBERS, "normal"),
    "isnan": (jnp.isnan, INEXACT, "special"),
    "isinf": (jnp.isinf, FLOATS, "special"),
    "isfinite": (jnp.isfinite, INEXACT, "special"),
    "signbit": (jnp.signbit, FLOATS, "special"),
    "logical_not": (jnp.logical_not, BOOL + INTS, "normal"),
    "invert": (jnp.invert, BOOL + INTS, "normal"),
    "conj": (jnp.conj, NUMBERS, "normal"),
    "real": (jnp.real, COMPLEX + FLOATS, "normal"),
    "imag": (jnp.imag, COMPLEX, "normal"),
    "angle": (jnp.angle, COMPLEX + FLOATS, "normal"),
    "astype_f32": (lambda x: x.astype(jnp.float32), ALL, "normal"),
    "astype_bool": (lambda x: x.astype(bool), NUMBERS, "special"),
    "population_count": (lax.population_count, INTS, "normal"),
    "clz": (lax.clz, INTS, "normal"),
    "logistic": (lax.logistic, FLOATS, "normal"),
    "erf": (lax.erf, FLOATS, "normal"),
    "erf_inv": (lax.erf_inv, FLOATS, "unit"),
    "lgamma": (lax.lgamma, FLOATS, "positive"),
    "digamma": (lax.digamma, FLOATS, "positive"),
    "bessel_i0e": (lax.bessel_i0e, FLOATS, "normal"),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), FLOATS, "special"),
    "nan_to_num": (jnp.nan_to_num, INEXACT, "special"),
    "relu": (jax.nn.relu, FLOATS, "special"),
    "relu6": (jax.nn.relu6, FLOATS, "normal"),
    "sigmoid": (jax.nn.sigmoid, FLOATS, "normal"),
    "softplus": (jax.nn.softplus, FLOATS, "normal"),
    "silu": (jax.nn.silu, FLOATS, "normal"),
    "gelu_tanh": (ft.partial(jax.nn.gelu, approximate=True), FLOATS, "normal"),
    "gelu_erf": (ft.partial(jax.nn.gelu, approximate=False), FLOATS, "normal"),
    "elu": (jax.nn.elu, FLOATS, "normal"),
    "celu": (jax.nn.celu, FLOATS, "normal"),
    "selu": (jax.nn.selu, FLOATS, "normal"),
    "leaky_relu": (jax.nn.leaky_relu, FLOATS, "normal"),
    "hard_tanh": (jax.nn.hard_tanh, FLOATS, "normal"),
    "log_sigmoid": (jax.nn.log_sigmoid, FLOATS, "normal"),
    "scipy_expit": (jsp.special.expit, FLOATS, "normal"),
    "scipy_logit": (jsp.special.logit, FLOATS, "unit"),
    "scipy_gammaln": (jsp.special.gammaln, FLOATS, "positive"),
    "scipy_erfc": (jsp.special.erfc, FLOATS, "normal"),
    "scipy_ndtr": (jsp.special.ndtr, FLOATS, "normal"),
    "scipy_ndtri": (jsp.special.ndtri, FLOATS, "unit"),
    "scipy_entr": (jsp.special.entr, FLOATS, "positive"),
    "scipy_i0e": (jsp.special.i0e, FLOATS, "normal"),
    "scipy_norm_logpdf": (jsp.stats.norm.logpdf, FLOATS, "normal"),
    "scipy_norm_cdf": (jsp.stats.norm.cdf, FLOATS, "normal"),
}
for _name, (_fn, _dtypes, _kind) in _UNARY.items():
    _family(_name, _fn, _dtypes, _UNARY_SHAPES, kind=_kind)

_BINARY_SHAPES = [((2, 3), (2, 3)), ((2, 3), (3,)), ((1, 3), (4, 1)), ((), (3,)), ((0, 3), (1, 3))]

_BINARY = {
    "add": (jnp.add, ALL),
    "subtract": (jnp.subtract, NUMBERS),
    "multiply": (jnp.multiply, ALL),
    "true_divide": (jnp.true_divide, INEXACT),
    "floor_divide": (jnp.floor_divide, SIGNED + FLOATS),
    "remainder": (jnp.remainder, SIGNED + FLOATS),
    "fmod": (jnp.fmod, SIGNED + FLOATS),
    "power": (jnp.power, FLOATS + COMPLEX),
    "maximum": (jnp.maximum, ALL),
    "minimum": (jnp.minimum, NUMBERS),
    "arctan2": (jnp.arctan2, FLOATS),
    "hypot": (jnp.hypot, FLOATS),
    "logaddexp": (jnp.logaddexp, FLOATS),
    "copysign": (jnp.copysign, FLOATS),
    "nextafter": (jnp.nextafter, FLOATS),
    "equal": (jnp.equal, ALL),
    "less": (jnp.less, NUMBERS[: -len(COMPLEX)] if COMPLEX else NUMBERS),
    "greater_equal": (jnp.greater_equal, INTS + FLOATS),
    "logical_and": (jnp.logical_and, BOOL + INTS),
    "logical_xor": (jnp.logical_xor, BOOL + FLOATS),
    "bitwise_and": (jnp.bitwise_and, BOOL + INTS),
    "bitwise_or": (jnp.bitwise_or, BOOL + INTS),
    "bitwise_xor": (jnp.bitwise_xor, BOOL + INTS),
    "left_shift": (jnp.left_shift, INTS),
    "right_shift": (jnp.right_shift, INTS),
    "gcd": (jnp.gcd, SIGNED),
    "heaviside": (jnp.heaviside, FLOATS),
    "xlogy": (jsp.special.xlogy, FLOATS),
    "xlog1py": (jsp.special.xlog1py, FLOATS),
    "isclose": (jnp.isclose, FLOATS),
}
for _name, (_fn, _dtypes) in _BINARY.items():
    _family(_name, _fn, _dtypes, _BINARY_SHAPES)

# logaddexp2's jitted body holds a custom_jvp: eagerly quaxlike runs it op by op.
_family(
    "logaddexp2",
    jnp.logaddexp2,
    (np.dtype(np.float32),) + tuple(d for d in FLOATS if d != np.float32),  # float32 sampled
    [((5, 7), (5, 7))],
)

_family("where3", jnp.where, BOOL, [((2, 3), (2, 3), (2, 3)), ((0,), (0,), (0,))])
for _d in (np.float32, jnp.bfloat16, np.int8):
    _add(
        "where3_mixed",
        lambda c, x, y: jnp.where(c > 0, x, y),
        [array(0, (4, 3), np.float32), array(1, (4, 3), _d), array(2, (3,), _d)],
        suffix=name_of(_d),
    )
_family("clip", lambda x, lo, hi: jnp.clip(x, lo, hi), INTS + FLOATS, [((3, 4), (), (4,))])
_family("select_n", lambda p, x, y: lax.select_n(p, x, y), BOOL, [((4,), (4,), (4,))])
_family("clamp", lambda lo, x, hi: lax.clamp(lo, x, hi), FLOATS + SIGNED, [((), (6,), ())])

# Mixed dtypes with JAX's default promotion.
_MIXED = [(np.int8, np.float32), (np.bool_, np.int32), (jnp.bfloat16, np.float16)]
_MIXED += [(np.uint8, np.int8), (np.float32, np.complex64)]
for _a, _b in _MIXED:
    if jax.dtypes.canonicalize_dtype(_a) == np.dtype(_a):
        _add(
            "promote_add",
            jnp.add,
            [array(0, (3,), _a), array(1, (2, 3), _b)],
            suffix=f"{name_of(_a)}_{name_of(_b)}",
        )
_add("python_scalar", lambda x: x * 2 + 1.5, [array(0, (3,), np.float16)], first=True)
_add("python_scalar_int", lambda x: (x + 3) // 2, [array(0, (3,), np.int8)])


# --- reductions ---------------------------------------------------------------------

_RED_SHAPES = [(3, 4, 2), (0, 3), (5,), ()]


def _axes(shape):
    yield None, False
    if shape:
        yield 0, False
        yield -1, True
    if len(shape) >= 3:
        yield (0, 2), False
        yield (0, 2), True


def _reduction(family, fn, dtypes, *, empty_ok=True, where=False, dtype_kw=None):
    first = True
    for dtype in dtypes:
        for shape in _RED_SHAPES:
            if not empty_ok and 0 in shape:
                continue
            for axis, keepdims in _axes(shape):
                x = array(0, shape, dtype)
                suffix = f"{name_of(dtype)}-{_shape_id(shape)}-ax{axis}-k{int(keepdims)}"
                _add(
                    family,
                    ft.partial(fn, axis=axis, keepdims=keepdims),
                    [x],
                    suffix=suffix,
                    first=first,
                )
                first = False
                if where and shape:
                    mask = array(1, shape, np.bool_)
                    _add(
                        family,
                        lambda x, m, axis=axis, keepdims=keepdims: fn(
                            x, axis=axis, keepdims=keepdims, where=m
                        ),
                        [x, mask],
                        suffix=suffix + "-where",
                    )
                if dtype_kw is not None:
                    _add(
                        family,
                        ft.partial(fn, axis=axis, keepdims=keepdims, dtype=dtype_kw),
                        [x],
                        suffix=suffix + f"-dtype{name_of(dtype_kw)}",
                    )


_reduction("sum", jnp.sum, ALL, where=True, dtype_kw=np.float32)
_reduction("prod", jnp.prod, NUMBERS, where=True)
_reduction("max", ft.partial(jnp.max, initial=-100), INTS + FLOATS, where=True)
_reduction("min", jnp.min, INTS + FLOATS, empty_ok=False)
_reduction("mean", jnp.mean, NUMBERS, empty_ok=False, where=True, dtype_kw=np.float32)
_reduction("var", jnp.var, FLOATS + COMPLEX, empty_ok=False)
_reduction("std", ft.partial(jnp.std, ddof=1), FLOATS, empty_ok=False)
_reduction("any", jnp.any, BOOL + INTS, where=True)
_reduction("all", jnp.all, BOOL + FLOATS, where=True)
_reduction("count_nonzero", jnp.count_nonzero, ALL)
_reduction("nansum", jnp.nansum, FLOATS)
_reduction("logsumexp", jsp.special.logsumexp, FLOATS, empty_ok=False, where=True)
_reduction("nn_logsumexp", jax.nn.logsumexp, FLOATS, empty_ok=False)
for _d in INTS + FLOATS:
    for _shape, _axis in (((3, 4), 1), ((5,), 0), ((2, 3, 4), 0)):
        _x = array(3, _shape, _d)
        _s = f"{name_of(_d)}-{_shape_id(_shape)}-ax{_axis}"
        _add("argmax", ft.partial(jnp.argmax, axis=_axis), [_x], suffix=_s, first=_d == INTS[0])
        _add("argmin", ft.partial(jnp.argmin, axis=_axis, keepdims=True), [_x], suffix=_s)
        _add("cumsum", ft.partial(jnp.cumsum, axis=_axis), [_x], suffix=_s)
        _add("cumprod", ft.partial(jnp.cumprod, axis=_axis), [_x], suffix=_s)
        _add("cummax", ft.partial(lax.cummax, axis=_axis, reverse=True), [_x], suffix=_s)
        _add("sort", ft.partial(jnp.sort, axis=_axis), [_x], suffix=_s)
        _add("argsort", ft.partial(jnp.argsort, axis=_axis, stable=True), [_x], suffix=_s)
for _d in FLOATS:
    _x = array(4, (3, 5), _d)
    _s = name_of(_d)
    _add("softmax", ft.partial(jax.nn.softmax, axis=-1), [_x], suffix=_s, first=True)
    _add("log_softmax", ft.partial(jax.nn.log_softmax, axis=(0, 1)), [_x], suffix=_s)
    _add(
        "softmax_where",
        lambda x, m: jax.nn.softmax(x, axis=0, where=m),
        [_x, array(5, (3, 5), np.bool_)],
        suffix=_s,
    )
    _add("standardize", ft.partial(jax.nn.standardize, axis=-1), [_x], suffix=_s)
    _add("cumlogsumexp", ft.partial(lax.cumlogsumexp, axis=1), [_x], suffix=_s)
    _add(
        "logsumexp_b_sign",
        lambda x, b: jsp.special.logsumexp(x, axis=1, b=b, return_sign=True),
        [_x, array(6, (3, 5), _d)],
        suffix=_s,
    )
    _add("ptp", ft.partial(jnp.ptp, axis=0), [_x], suffix=_s)
    _add("median", ft.partial(jnp.median, axis=1), [_x], suffix=_s)
    _add("percentile", lambda x: jnp.percentile(x, 30.0, axis=0), [_x], suffix=_s)


# --- structure ----------------------------------------------------------------------

# Structural calls that also run on a zero-size input (2, 0, 4).
_WITH_EMPTY = ("reshape", "transpose", "flip", "concatenate", "pad_constant", "ravel")
for _d in (np.bool_, np.int8, np.int32, jnp.bfloat16, np.float32, np.complex64):
    _d = jax.dtypes.canonicalize_dtype(_d)
    _x = array(7, (2, 3, 4), _d)
    _e = array(8, (2, 0, 4), _d)
    _s = name_of(_d)
    _first = _d == np.bool_
    for _family_name, _fn in {
        "reshape": lambda x: x.reshape(4, -1),
        "transpose": lambda x: jnp.transpose(x, (2, 0, 1)),
        "moveaxis": lambda x: jnp.moveaxis(x, 0, -1),
        "swapaxes": lambda x: jnp.swapaxes(x, 0, 2),
        "expand_squeeze": lambda x: jnp.squeeze(jnp.expand_dims(x, (0, 3)), 0),
        "flip": lambda x: jnp.flip(x, (0, 2)),
        "roll": lambda x: jnp.roll(x, 2, axis=-1),
        "tile": lambda x: jnp.tile(x, (2, 1, 1)),
        "repeat": lambda x: jnp.repeat(x, 2, axis=1),
        "pad_constant": lambda x: jnp.pad(x, ((1, 0), (0, 2), (1, 1))),
        "pad_reflect": lambda x: jnp.pad(x, ((0, 0), (1, 1), (2, 0)), mode="reflect"),
        "pad_edge": lambda x: jnp.pad(x, 1, mode="edge"),
        "lax_pad_interior": lambda x: lax.pad(
            x, x.dtype.type(0), [(0, 0, 0), (1, -1, 1), (0, 0, 2)]
        ),
        "broadcast_to": lambda x: jnp.broadcast_to(x[:, :1], (5, 2, 3, 4)),
        "split": lambda x: jnp.split(x, [1, 3], axis=2),
        "concatenate": lambda x: jnp.concatenate([x, x[:, :1]], axis=1),
        "stack": lambda x: jnp.stack([x, x], axis=-1),
        "ravel": jnp.ravel,
        "rev": lambda x: lax.rev(x, (1,)),
        "slice_step": lambda x: x[::-1, 1:, ::2],
        "index_int": lambda x: x[1, -1],
        "index_newaxis_ellipsis": lambda x: x[None, ..., 1],
        "tril": lambda x: jnp.tril(x[0], k=1),
        "diagonal": lambda x: jnp.diagonal(x, axis1=1, axis2=2),
        "at_set": lambda x: x.at[0, 1:].set(x[1, :2]),
        "at_add": lambda x: x.at[:, 1].add(x[:, 2]),
        "at_min": lambda x: x.at[1].min(x[0]),
        "unique_size": lambda x: jnp.unique(x, size=6, fill_value=x.ravel()[0]),
        "nonzero_size": lambda x: jnp.nonzero(x, size=5, fill_value=0),
    }.items():
        if _d == np.bool_ and _family_name in ("at_add",):
            continue
        _add(_family_name, _fn, [_x], suffix=_s, first=_first)
        if _family_name in _WITH_EMPTY:
            _add(_family_name, _fn, [_e], suffix=f"{_s}-empty")

for _d in (np.int32, np.float32, jnp.bfloat16):
    _x = array(9, (5, 4), _d)
    _i = array(10, (3,), np.int32, kind="positive") % 4
    _s = name_of(_d)
    _add("take", lambda x, i: jnp.take(x, i, axis=1), [_x, _i], suffix=_s, first=True)
    _add("take_clip", lambda x, i: jnp.take(x, i * 3, axis=0, mode="clip"), [_x, _i], suffix=_s)
    _add("take_fill", lambda x, i: jnp.take(x, i * 3, axis=0, mode="fill"), [_x, _i], suffix=_s)
    _add(
        "take_along_axis",
        lambda x, i: jnp.take_along_axis(x, jnp.argsort(x, axis=0), axis=0),
        [_x, _i],
        suffix=_s,
    )
    _add("gather_advanced", lambda x, i: x[i, i[::-1]], [_x, _i], suffix=_s)
    _add("scatter_array_idx", lambda x, i: x.at[i].add(1), [_x, _i], suffix=_s)
    _add("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i[0], 1), (2, 2)), [_x, _i], suffix=_s)
    _add(
        "dynamic_update_slice",
        lambda x, i: lax.dynamic_update_slice(x, x[:2, :2] * 2, (i[1], i[0])),
        [_x, _i],
        suffix=_s,
    )
    _add(
        "searchsorted", lambda x, v: jnp.searchsorted(jnp.sort(x[:, 0]), v), [_x, _x[0]], suffix=_s
    )
    _add("top_k", lambda x: lax.top_k(x, 2), [_x], suffix=_s)
    _add("diff", lambda x: jnp.diff(x, n=2, axis=0), [_x], suffix=_s)
    _add("one_hot", lambda i: jax.nn.one_hot(i, 5, dtype=_d), [_i], suffix=_s)
    _add(
        "bitcast",
        lambda x: lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32),
        [_x],
        suffix=_s,
    )
    _add("lax_sort_multi", lambda x: lax.sort((x[:, 0], x[:, 1]), num_keys=1), [_x], suffix=_s)


# --- linear algebra and contractions ------------------------------------------------

for _d in (np.int8, np.int32, jnp.bfloat16, np.float16, np.float32, np.complex64):
    _d = jax.dtypes.canonicalize_dtype(_d)
    _a = array(11, (3, 4), _d)
    _b = array(12, (4, 2), _d)
    _s = name_of(_d)
    _first = _d == np.int8
    _add("matmul", jnp.matmul, [_a, _b], suffix=_s, first=_first)
    _add("matmul_batched", jnp.matmul, [array(13, (2, 3, 4), _d), _b], suffix=_s)
    _add("dot_vec", jnp.dot, [_a[0], _a[1]], suffix=_s)
    _add("vdot", jnp.vdot, [_a, _a], suffix=_s)
    _add("outer", jnp.outer, [_a[0], _b[:, 0]], suffix=_s)
    _add("kron", jnp.kron, [_a[:2, :2], _b[:2]], suffix=_s)
    _add("tensordot", lambda a, b: jnp.tensordot(a, b, axes=1), [_a, _b], suffix=_s)
    _add("einsum", lambda a, b: jnp.einsum("ij,jk->ki", a, b), [_a, _b], suffix=_s)
    _add("einsum_trace", lambda a: jnp.einsum("ii", a[:, :3]), [_a], suffix=_s)
    _add("matmul_empty", jnp.matmul, [array(14, (3, 0), _d), array(15, (0, 2), _d)], suffix=_s)
    if _d != np.complex64:
        _add(
            "dot_general_preferred",
            lambda a, b: lax.dot_general(
                a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            ),
            [_a, _b],
            suffix=_s,
        )
    _add("trace", jnp.trace, [_a], suffix=_s)
    _add("cross", lambda a: jnp.cross(a[:2, :3], a[1:, 1:]), [_a], suffix=_s)

_CONV_DTYPES = (np.float32, jnp.bfloat16, np.float16)
for _d in _CONV_DTYPES:
    _s = name_of(_d)
    _img = array(16, (2, 3, 9, 8), _d)
    _ker = array(17, (4, 3, 3, 2), _d)
    _add(
        "conv_nchw",
        lambda x, k: lax.conv_general_dilated(x, k, (2, 1), "SAME", rhs_dilation=(1, 2)),
        [_img, _ker],
        suffix=_s,
        first=True,
    )
    _add(
        "conv_grouped",
        lambda x, k: lax.conv_general_dilated(
            x, k[:, :1], (1, 1), [(1, 0), (0, 1)], feature_group_count=3
        ),
        [_img, array(18, (3, 3, 3, 2), _d)],
        suffix=_s,
    )
    _add(
        "convolve_full",
        lambda a, b: jnp.convolve(a, b),
        [_img[0, 0, 0], _img[0, 0, 1, :3]],
        suffix=_s,
    )
    _add(
        "scipy_convolve2d",
        lambda a, b: jsp.signal.convolve2d(a, b, mode="same"),
        [_img[0, 0], _ker[0, 0]],
        suffix=_s,
    )

for _d in FLOATS[2:] + COMPLEX:
    _s = name_of(_d)
    _m = array(19, (4, 4), _d) + 4 * np.eye(4, dtype=_d)
    _v = array(20, (4, 2), _d)
    _add("inv", jnp.linalg.inv, [_m], suffix=_s, first=True)
    _add("det", jnp.linalg.det, [_m], suffix=_s)
    _add("slogdet", jnp.linalg.slogdet, [_m], suffix=_s)
    _add("solve", jnp.linalg.solve, [_m, _v], suffix=_s)
    _add("cholesky", lambda m: jnp.linalg.cholesky(m @ jnp.conj(m.T)), [_m], suffix=_s)
    _add("qr", jnp.linalg.qr, [_m], suffix=_s)
    _add("eigh", lambda m: jnp.linalg.eigh(m + jnp.conj(m.T)), [_m], suffix=_s)
    _add("svd_values", lambda m: jnp.linalg.svd(m, compute_uv=False), [_m], suffix=_s)
    _add("norm_fro", jnp.linalg.norm, [_m], suffix=_s)
    _add("norm_ord1_axis", lambda m: jnp.linalg.norm(m, ord=1, axis=0), [_m], suffix=_s)
    _add(
        "solve_triangular",
        lambda m, v: jsp.linalg.solve_triangular(jnp.triu(m), v),
        [_m, _v],
        suffix=_s,
    )
    _add("expm", jsp.linalg.expm, [_m / 4], suffix=_s)
    _add("lu_factor", jsp.linalg.lu_factor, [_m], suffix=_s)
    _add("fft", jnp.fft.fft, [_m], suffix=_s)
    _add("rfft_irfft", lambda m: jnp.fft.irfft(jnp.fft.rfft(jnp.real(m))), [_m], suffix=_s)


# --- control flow -------------------------------------------------------------------

for _d in (np.int32, np.float32, jnp.bfloat16):
    _s = name_of(_d)
    _x = array(21, (5,), _d)
    _add(
        "cond",
        lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x.astype(jnp.float32)),
        [_x],
        suffix=_s,
        first=True,
    )
    _add(
        "switch",
        lambda x: lax.switch(jnp.argmax(x) % 3, [lambda v: v, lambda v: -v, jnp.abs], x),
        [_x],
        suffix=_s,
    )
    _add("fori_loop", lambda x: lax.fori_loop(0, 4, lambda i, c: c * 2 + x, x), [_x], suffix=_s)
    _add(
        "while_loop",
        lambda x: lax.while_loop(lambda c: c[0] < 40, lambda c: c * 2 + 1, jnp.abs(x) + 1),
        [_x],
        suffix=_s,
    )
    _add("scan", lambda x: lax.scan(lambda c, v: (c + v, c * v), x[0], x), [_x], suffix=_s)
    _add("map", lambda x: lax.map(lambda v: v * v, x.reshape(5, 1)), [_x], suffix=_s)
    _add(
        "vmap_inside", lambda x: jax.vmap(jnp.outer, (0, None))(x.reshape(5, 1), x), [_x], suffix=_s
    )
    _add("jit_inside", lambda x: jax.jit(lambda v: v * 3 - 1)(x), [_x], suffix=_s)
    _add(
        "checkpoint",
        lambda x: jax.checkpoint(lambda v: jnp.sin(v.astype(jnp.float32)) * 2)(x),
        [_x],
        suffix=_s,
    )
    _add("associative_scan", lambda x: lax.associative_scan(jnp.add, x), [_x], suffix=_s)
_add(
    "grad_inside",
    lambda x: jax.grad(lambda v: jnp.sum(jnp.sin(v) * v))(x),
    [array(22, (4,), np.float32)],
    first=True,
)
_add(
    "jvp_inside",
    lambda x: jax.jvp(jnp.tanh, (x,), (jnp.ones_like(x),)),
    [array(23, (4,), np.float32)],
)


# --- issue 25's items: calls that need a concrete value or return a constant ---------

_z = np.array([0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.0], np.float32)
# Calls that need a concrete value: eagerly, a DenseArrayValue answers as the
# array it wraps; under jit they raise JAX's own error, as plain JAX does.
_CONCRETE_CASES = {
    "item": (lambda a: a.sum().item(), [_z]),
    "nonzero": (jnp.nonzero, [_z]),
    "argwhere": (jnp.argwhere, [_z.reshape(7, 1)]),
    "polymul": (jnp.polymul, [_z[2:4], _z[3:6]]),
    "polydiv": (
        jnp.polydiv,
        [np.array([1.0, 3.0, 2.0], np.float32), np.array([1.0, 1.0], np.float32)],
    ),
    "float_of": (lambda a: float(a[2]), [_z]),
    "python_if": (lambda a: a * 2 if a[3] > 1 else a, [_z]),
}
for _name, (_fn, _args) in _CONCRETE_CASES.items():
    _add(f"concrete_{_name}", _fn, _args, first=True)
_ITEM1_CASES = {
    "trim_zeros": (jnp.trim_zeros, [_z]),
    "bincount": (jnp.bincount, [np.array([0, 1, 1, 3], np.int32)]),
    "unique": (jnp.unique, [_z]),
    "boolean_mask": (lambda a, m: a[m], [_z, _z > 0]),
    "boolean_mask_empty": (lambda a, m: a[m], [_z[:0], _z[:0] > 0]),
    "ravel_multi_index": (
        lambda i, j: jnp.ravel_multi_index((i, j), (3, 4)),
        [np.array([0, 2], np.int32), np.array([1, 3], np.int32)],
    ),
}
for _name, (_fn, _args) in _ITEM1_CASES.items():
    _add(f"concrete_{_name}", _fn, _args, first=True)

_ITEM2_CASES = {
    "jit_returns_constant": (jax.jit(lambda x: (x * 2, 1.0)), [_z]),
    "average_returned": (lambda a: jnp.average(a, returned=True), [_z]),
    "polyfit_full": (lambda a, b: jnp.polyfit(a, b, 1, full=True), [_z, _z * 2 + 1]),
    "cov_empty": (jnp.cov, [np.ones((0,), np.float32)]),
}
for _name, (_fn, _args) in _ITEM2_CASES.items():
    _add(f"literal_{_name}", _fn, _args, first=True)


CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "duplicate case names"
SAMPLE = frozenset(c.name for c in CASES if c.sampled)
