"""Property tests: random shapes, dtypes, broadcasting and Value positions for
elementwise and reduction primitives, and random short compositions of operations,
each compared with plain JAX (values, shapes, dtypes and weak types).

`max_examples` is bounded and the examples are derandomised, so a run is
reproducible and takes seconds; `--run-slow` multiplies the bound by eight (the
`examples` fixture in conftest.py).
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _table import assert_same, Tracked

import quaxlike


def _settings(max_examples: int):
    return hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True)


# --- inputs -----------------------------------------------------------------------

_DTYPES = {
    "float32": np.float32,
    "int32": np.int32,
    "bool": np.bool_,
    "complex64": np.complex64,
    "uint8": np.uint8,
    "bfloat16": jnp.bfloat16,
}


def _array(seed: int, shape, dtype_name: str):
    rng = np.random.default_rng(seed)
    if dtype_name == "bool":
        return jnp.asarray(rng.integers(0, 2, shape).astype(bool))
    if dtype_name in ("int32", "uint8"):
        low = 0 if dtype_name == "uint8" else -5
        return jnp.asarray(rng.integers(low, 6, shape).astype(_DTYPES[dtype_name]))
    if dtype_name == "complex64":
        return jnp.asarray(
            (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64)
        )
    return jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(_DTYPES[dtype_name])


@st.composite
def _broadcastable_shapes(draw):
    """Two shapes that broadcast together, of possibly different ranks."""
    ndim = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    x_shape = tuple(d if draw(st.booleans()) else 1 for d in shape)
    y_shape = tuple(d if draw(st.booleans()) else 1 for d in shape)
    y_shape = y_shape[draw(st.integers(0, len(y_shape))) :]  # rank broadcasting
    return x_shape, y_shape


def _wrap_some(draw, args):
    """Wrap a non-empty random subset of the array arguments in `Tracked`."""
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    chosen = draw(st.lists(st.sampled_from(arrays), min_size=1, unique=True))
    return tuple(Tracked(a) if i in chosen else a for i, a in enumerate(args))


def _run(fn, args, wrapped, tol=None):
    with jax.check_tracer_leaks(False):  # see test_conformance.no_leak_check
        expected = fn(*args)
        out = quaxlike.quaxify(fn)(*wrapped)
    leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, Tracked))
    assert all(isinstance(x, Tracked) for x in leaves), "the output lost its Value"
    if tol is None and _has_bf16(args):
        tol = {"rtol": 2e-2, "atol": 2e-2}
    assert_same(out, expected, tol=tol)


def _has_bf16(args) -> bool:
    return any(getattr(a, "dtype", None) == jnp.bfloat16 for a in args)


# --- elementwise ------------------------------------------------------------------

# name -> (function, dtypes it accepts)
_BINARY = {
    "add": (jnp.add, ["float32", "int32", "complex64", "uint8", "bfloat16", "bool"]),
    "sub": (jnp.subtract, ["float32", "int32", "complex64", "bfloat16"]),
    "mul": (jnp.multiply, ["float32", "int32", "complex64", "uint8", "bfloat16", "bool"]),
    "max": (jnp.maximum, ["float32", "int32", "uint8", "bool", "bfloat16"]),
    "min": (jnp.minimum, ["float32", "int32", "uint8", "bool"]),
    "eq": (jnp.equal, ["float32", "int32", "complex64", "bool"]),
    "lt": (jnp.less, ["float32", "int32", "uint8"]),
    "and": (jnp.bitwise_and, ["int32", "uint8", "bool"]),
    "xor": (jnp.bitwise_xor, ["int32", "bool"]),
    "atan2": (jnp.arctan2, ["float32"]),
    "where": (lambda x, y: jnp.where(x > y, x, y), ["float32", "int32", "uint8"]),
    "true_divide": (jnp.true_divide, ["float32", "complex64"]),
}
_BINARY_CASES = [(name, dtype) for name, (_, dtypes) in _BINARY.items() for dtype in dtypes]

# A Python scalar as the second operand: weak typing decides the result dtype.
_SCALARS = {"none": None, "int": 3, "float": 0.5, "bool": True}


@st.composite
def _binary_problem(draw):
    name, dtype = draw(st.sampled_from(_BINARY_CASES))
    x_shape, y_shape = draw(_broadcastable_shapes())
    y_dtype = draw(st.sampled_from([dtype, dtype, "float32", "int32"]))
    scalar = draw(st.sampled_from(sorted(_SCALARS)))
    seed = draw(st.integers(0, 2**16))
    x = _array(seed, x_shape, dtype)
    y = _array(seed + 1, y_shape, y_dtype) if scalar == "none" else _SCALARS[scalar]
    if name in ("and", "xor") and (jnp.result_type(x, y) not in (jnp.int32, jnp.uint8, jnp.bool_)):
        y = _array(seed + 1, y_shape, dtype)  # bitwise needs integer/bool operands
    return name, (x, y), _wrap_some(draw, (x, y))


@pytest.mark.loose_promotion  # mixes dtypes on purpose
def test_elementwise_binary(examples):
    @_settings(examples(30))
    @hypothesis.given(_binary_problem())
    def check(problem):
        name, args, wrapped = problem
        try:
            jax.eval_shape(_BINARY[name][0], *args)
        except TypeError:
            hypothesis.reject()  # a dtype combination JAX itself refuses
        _run(_BINARY[name][0], args, wrapped)

    check()


_UNARY = {
    "neg": (jnp.negative, ["float32", "int32", "complex64", "bfloat16"]),
    "abs": (jnp.abs, ["float32", "int32", "complex64", "bfloat16"]),
    "exp": (jnp.exp, ["float32", "complex64", "bfloat16"]),
    "sin": (jnp.sin, ["float32", "complex64"]),
    "tanh": (jnp.tanh, ["float32", "bfloat16"]),
    "sign": (jnp.sign, ["float32", "int32"]),
    "not": (jnp.invert, ["int32", "uint8", "bool"]),
    "square": (jnp.square, ["float32", "int32", "complex64"]),
    "isfinite": (jnp.isfinite, ["float32", "bfloat16"]),
    "to_float": (lambda x: x.astype(jnp.float32), ["int32", "bool", "uint8", "bfloat16"]),
    "to_int": (lambda x: x.astype(jnp.int32), ["float32", "bool", "uint8"]),
    "real": (jnp.real, ["complex64", "float32"]),
}
_UNARY_CASES = [(name, dtype) for name, (_, dtypes) in _UNARY.items() for dtype in dtypes]


def test_elementwise_unary(examples):
    @_settings(examples(20))
    @hypothesis.given(
        st.sampled_from(_UNARY_CASES),
        st.lists(st.integers(1, 4), min_size=0, max_size=3),
        st.integers(0, 2**16),
    )
    def check(case, shape, seed):
        name, dtype = case
        x = _array(seed, tuple(shape), dtype)
        _run(_UNARY[name][0], (x,), (Tracked(x),))

    check()


# --- reductions -------------------------------------------------------------------

_REDUCTIONS = {
    "sum": (
        lambda x, axis, keepdims: jnp.sum(x, axis=axis, keepdims=keepdims),
        ["float32", "int32", "bool", "complex64", "uint8"],
    ),
    "prod": (
        lambda x, axis, keepdims: jnp.prod(x, axis=axis, keepdims=keepdims),
        ["float32", "int32"],
    ),
    "max": (
        lambda x, axis, keepdims: jnp.max(x, axis=axis, keepdims=keepdims),
        ["float32", "int32", "bool", "uint8"],
    ),
    "min": (
        lambda x, axis, keepdims: jnp.min(x, axis=axis, keepdims=keepdims),
        ["float32", "int32"],
    ),
    "mean": (
        lambda x, axis, keepdims: jnp.mean(x, axis=axis, keepdims=keepdims),
        ["float32", "int32", "complex64"],
    ),
    "any": (
        lambda x, axis, keepdims: jnp.any(x, axis=axis, keepdims=keepdims),
        ["bool", "float32"],
    ),
    "all": (lambda x, axis, keepdims: jnp.all(x, axis=axis, keepdims=keepdims), ["bool", "int32"]),
    "argmax": (
        lambda x, axis, keepdims: jnp.argmax(x, axis=axis, keepdims=keepdims),
        ["float32", "int32"],
    ),
    "var": (lambda x, axis, keepdims: jnp.var(x, axis=axis, keepdims=keepdims), ["float32"]),
    "logsumexp": (
        lambda x, axis, keepdims: jax.nn.logsumexp(x, axis=axis, keepdims=keepdims),
        ["float32"],
    ),
    "cumsum": (lambda x, axis, keepdims: jnp.cumsum(x, axis=axis), ["float32", "int32", "bool"]),
    "cummax": (lambda x, axis, keepdims: jax.lax.cummax(x, axis=axis or 0), ["float32", "int32"]),
}
_REDUCTION_CASES = [(n, d) for n, (_, dtypes) in _REDUCTIONS.items() for d in dtypes]
_SINGLE_AXIS = {"argmax", "cumsum", "cummax"}


@st.composite
def _reduction_problem(draw):
    name, dtype = draw(st.sampled_from(_REDUCTION_CASES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    if name in _SINGLE_AXIS:
        axis = draw(st.integers(-ndim, ndim - 1))
    else:
        axis = draw(
            st.one_of(
                st.none(),
                st.integers(-ndim, ndim - 1),
                st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True).map(
                    tuple
                ),
            )
        )
    keepdims = draw(st.booleans()) and name not in ("cumsum", "cummax")
    seed = draw(st.integers(0, 2**16))
    return name, _array(seed, shape, dtype), axis, keepdims


def test_reduction(examples):
    @_settings(examples(25))
    @hypothesis.given(_reduction_problem())
    def check(problem):
        name, x, axis, keepdims = problem
        fn = lambda x: _REDUCTIONS[name][0](x, axis, keepdims)  # noqa: E731
        _run(fn, (x,), (Tracked(x),), tol={"rtol": 1e-4, "atol": 1e-5})

    check()


# --- random compositions ----------------------------------------------------------

# Each step maps the running value `z` (and the second input `y`, same shape as the
# first) to a new value; all steps keep float32 and accept any shape.
_STEPS = {
    "tanh": lambda z, y: jnp.tanh(z),
    "add_y": lambda z, y: z + y,
    "mul_y": lambda z, y: z * y,
    "scale": lambda z, y: 2.5 * z - 1.0,
    "relu": lambda z, y: jax.nn.relu(z),
    "where": lambda z, y: jnp.where(z > y, z, y * 0.5),
    "square": lambda z, y: z**2,
    "flip": lambda z, y: jnp.flip(z),
    "cumsum": lambda z, y: jnp.cumsum(z, axis=-1) if z.ndim else z,
    "softmax": lambda z, y: jax.nn.softmax(z) if z.ndim else z,
    "sort": lambda z, y: jnp.sort(z, axis=-1) if z.ndim else z,
    "transpose": lambda z, y: z.T,
    "matmul_yT": lambda z, y: (z @ y.T) / 4.0 if z.ndim == 2 else z * y,
    "roundtrip_int": lambda z, y: (z * 3.0).astype(jnp.int32).astype(jnp.float32),
    "pad_slice": lambda z, y: jnp.pad(z, 1)[(slice(1, -1),) * z.ndim],
    "mean_keep": lambda z, y: z - jnp.mean(z, axis=-1, keepdims=True) if z.ndim else z,
    "cond": lambda z, y: jax.lax.cond(jnp.sum(z) > 0, jnp.sin, jnp.cos, z),
    "scan_rows": lambda z, y: (
        jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros_like(z[0]), z)[1] if z.ndim else z
    ),
}


@st.composite
def _composition(draw):
    # Square, so that `transpose` keeps the shape the other steps expect.
    shape = (draw(st.integers(1, 4)),) * draw(st.integers(0, 2))
    steps = draw(st.lists(st.sampled_from(sorted(_STEPS)), min_size=2, max_size=4))
    seed = draw(st.integers(0, 2**16))
    x, y = _array(seed, shape, "float32"), _array(seed + 1, shape, "float32")
    return steps, (x, y), _wrap_some(draw, (x, y))


def test_composition(examples):
    @_settings(examples(20))
    @hypothesis.given(_composition())
    def check(problem):
        steps, args, wrapped = problem

        def fn(x, y):
            z = x
            for step in steps:
                z = _STEPS[step](z, y)
            return z

        with jax.check_tracer_leaks(False):
            expected = fn(*args)
            out = quaxlike.quaxify(fn)(*wrapped)
        assert_same(out, expected, tol={"rtol": 1e-4, "atol": 1e-4}, where=" -> ".join(steps))

    check()
