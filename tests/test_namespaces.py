"""`quaxlike.numpy` and `quaxlike.lax`: every public name of `jax.numpy` and
`jax.lax` (and their submodules) is there, functions accept Values, and the
results match plain JAX on the materialised arrays."""

import importlib
import inspect
import types
import typing

import jax
import jax.extend.core as jex
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import materialise_tree, PassThrough, randn, tree_allclose
from jax import lax

import quaxlike
import quaxlike.lax as qlax
import quaxlike.numpy as qnp
from quaxlike.lora import LoraArray
from quaxlike.numpy._mirror import QuaxifiedUfunc
from quaxlike.symbolic.zero import Zero


_MIRRORS = [
    (qnp, jnp),
    (qnp.linalg, jnp.linalg),
    (qnp.fft, jnp.fft),
    (qlax, lax),
    (qlax.linalg, lax.linalg),
]


def _public(module):
    return [name for name in dir(module) if not name.startswith("_")]


def _is_plain_function(obj) -> bool:
    # The spec: functions are quaxified; classes (dtypes included), primitives,
    # typing aliases and non-callables are passed through unchanged.
    return (
        callable(obj)
        and not isinstance(obj, type)
        and not isinstance(obj, jex.Primitive)
        and typing.get_origin(obj) is None
    )


# --- every name is there -------------------------------------------------------------


@pytest.mark.parametrize(
    "mirror, source", _MIRRORS, ids=[source.__name__ for _, source in _MIRRORS]
)
def test_every_public_name_is_reachable(mirror, source):
    names = _public(source)
    assert set(names) <= set(dir(mirror))
    assert mirror.__all__ == names
    wrapped = 0
    for name in names:
        original = getattr(source, name)
        mirrored = getattr(mirror, name)
        if isinstance(original, types.ModuleType):
            assert isinstance(mirrored, types.ModuleType)
            assert mirrored.__name__ == f"{mirror.__name__}.{name}"
        elif _is_plain_function(original):
            wrapped += 1
            assert mirrored is not original, name
            assert mirrored.__wrapped__ is original, name
            assert mirrored.__doc__ == original.__doc__, name
            assert getattr(mirrored, "__name__", None) == getattr(original, "__name__", None)
            assert getattr(mirror, name) is mirrored, name  # cached
        else:
            assert mirrored is original, name
    assert wrapped > len(names) // 3


def test_non_functions_pass_through_unchanged():
    assert qnp.float32 is jnp.float32 and qnp.bfloat16 is jnp.bfloat16
    assert qnp.ndarray is jnp.ndarray is jax.Array
    assert qnp.dtype is jnp.dtype and qnp.finfo is jnp.finfo
    assert qnp.pi is jnp.pi and qnp.inf is jnp.inf and qnp.newaxis is None
    assert qnp.r_ is jnp.r_ and qnp.s_ is jnp.s_
    assert qlax.mul_p is lax.mul_p and qlax.Precision is lax.Precision
    assert qlax.DotDimensionNumbers is lax.DotDimensionNumbers
    x = jnp.ones(2)
    assert isinstance(x, qnp.ndarray) and x.astype(qnp.int32).dtype == jnp.int32


def test_functions_keep_signatures_and_docs():
    for mirrored, original in [
        (qnp.sum, jnp.sum),
        (qnp.einsum, jnp.einsum),
        (qnp.linalg.norm, jnp.linalg.norm),
        (qlax.dot_general, lax.dot_general),
        (qnp.add, jnp.add),
    ]:
        assert inspect.signature(mirrored) == inspect.signature(original)
        assert mirrored.__doc__ == original.__doc__
    assert qnp.add.nin == 2 and qnp.add.identity == 0
    # `frompyfunc` builds a ufunc, wrapped like `qnp.add` (`vectorize`, the other
    # function factory, is called with Values below).
    made = qnp.frompyfunc(jnp.multiply, 2, 1)
    assert isinstance(made, QuaxifiedUfunc) and made.nin == 2


def test_submodules_import_as_modules():
    assert importlib.import_module("quaxlike.numpy.linalg") is qnp.linalg
    assert importlib.import_module("quaxlike.lax.linalg") is qlax.linalg
    from quaxlike.numpy import fft

    assert fft is qnp.fft


def test_unknown_names_say_what_is_mirrored():
    with pytest.raises(AttributeError, match=r"'quaxlike\.numpy'.*'not_a_function'.*`jax\.numpy`"):
        qnp.not_a_function  # noqa: B018
    with pytest.raises(AttributeError, match=r"mirrors `jax\.lax\.linalg`"):
        qlax.linalg.not_a_function  # noqa: B018
    with pytest.raises(AttributeError):
        qnp._private  # noqa: B018


def test_without_values_the_function_is_jax_s_own():
    x = randn(0, (3,))
    out = qnp.sin(x)
    assert isinstance(out, jax.Array) and tree_allclose(out, jnp.sin(x))


# --- functions with Values, compared with plain JAX ---------------------------------------
#
# Each call below is a `quaxify` call, and (with the tracer-leak checker on) each
# `quaxify` call, including those the `jit` inside most `jax.numpy` functions
# adds, runs a full garbage collection: hence a sample rather than every function.


def _check(fn, reference, args):
    out = fn(*args)
    expected = reference(*materialise_tree(args))
    assert tree_allclose(materialise_tree(out), expected, rtol=1e-4, atol=1e-5)
    return out


def test_numpy_functions_on_pass_through(getseed):
    x = randn(getseed(), (3, 4))
    y = randn(getseed(), (4, 2))
    p, q = PassThrough(x), PassThrough(y)
    cases = [
        (lambda ns, a, b: ns.sin(a), (p, q)),
        (lambda ns, a, b: ns.sum(a, axis=0), (p, q)),
        (lambda ns, a, b: ns.matmul(a, b), (p, y)),
        (lambda ns, a, b: ns.einsum("ij,jk->ki", a, b), (x, q)),
        (lambda ns, a, b: ns.where(ns.greater(a, 0), a, 0.0), (p, q)),
        (lambda ns, a, b: ns.concatenate([a, ns.transpose(b)]), (p, q)),
        (lambda ns, a, b: ns.linalg.norm(a), (p, q)),
        (lambda ns, a, b: ns.fft.rfft(a), (p, q)),
        (lambda ns, a, b: ns.add.reduce(a, axis=1), (p, q)),
        (lambda ns, a, b: ns.vectorize(lambda s, t: s * t + 1.0)(a, a), (p, q)),
    ]
    for case, args in cases:
        out = _check(lambda *a: case(qnp, *a), lambda *a: case(jnp, *a), args)
        assert isinstance(out, PassThrough)


def test_lax_functions_on_pass_through(getseed):
    x = randn(getseed(), (3, 4))
    y = randn(getseed(), (4, 2))
    p = PassThrough(x)
    dims = (((1,), (0,)), ((), ()))
    cases = [
        (lambda ns, a: ns.dot_general(a, y, dims), (p,)),
        (lambda ns, a: ns.mul(a, a), (p,)),
        (lambda ns, a: ns.fori_loop(0, 3, lambda i, c: ns.mul(c, 2.0), a), (p,)),
    ]
    for case, args in cases:
        out = _check(lambda *a: case(qlax, *a), lambda *a: case(lax, *a), args)
        assert isinstance(out, PassThrough)


def test_under_jit(getseed):
    x = randn(getseed(), (3, 4))
    out = jax.jit(lambda v: qnp.mean(qnp.tanh(v), axis=1))(PassThrough(x))
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, jnp.mean(jnp.tanh(x), axis=1))


def test_zero_stays_symbolic(getseed):
    z = Zero((3, 4), jnp.float32)
    y = randn(getseed(), (4, 2))
    for out, shape in [
        (qnp.sin(z), (3, 4)),
        (qnp.matmul(z, y), (3, 2)),
        (qnp.sum(z, axis=0), (4,)),
        (qlax.mul(z, 3.0), (3, 4)),
    ]:
        assert isinstance(out, Zero) and out.shape == shape
    # Where no rule keeps it symbolic, it is materialised: exp(0) = 1.
    assert tree_allclose(qnp.exp(z), jnp.ones((3, 4)))


def test_lora_never_materialises(getseed):
    w = randn(getseed(), (3, 4))
    lora = LoraArray(w, rank=2, key=jax.random.key(0))
    lora = lora.with_factors(w, randn(getseed(), (3, 2)), randn(getseed(), (2, 4)))
    full = w + lora.a @ lora.b
    x = randn(getseed(), (4, 2))
    y = randn(getseed(), (5, 3))
    assert tree_allclose(qnp.matmul(lora, x), full @ x, rtol=1e-4, atol=1e-5)
    assert tree_allclose(qnp.dot(y, lora), y @ full, rtol=1e-4, atol=1e-5)
    out = qnp.transpose(lora)
    assert isinstance(out, LoraArray) and out.shape == (4, 3)
    dims = (((0,), (1,)), ((), ()))  # contract y.T (3, 5) with the transposed LoRA (4, 3)
    assert tree_allclose(qlax.dot_general(y.T, out, dims), y @ full, rtol=1e-4, atol=1e-5)


# --- compilation cache -----------------------------------------------------------------


def test_eager_jitted_function_compiles_once():
    # The `jit` rule reuses one jitted body per (jaxpr, non-array arguments), so
    # repeated eager calls hit JAX's compilation cache.
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    floor_divide = quaxlike.quaxify(jnp.floor_divide)
    p = PassThrough(jnp.arange(4.0))
    floor_divide(p, 2.0)  # compiles
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(2):
            out = floor_divide(p, 2.0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert np.array_equal(out.array, jnp.arange(4.0) // 2)
    assert compiles == []
