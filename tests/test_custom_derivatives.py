"""A custom derivative rule runs on every ready type, and its derivative is the
one it gives on the dense arrays.

For each type, `jax.jvp` and `jax.grad` of `quaxify(f)`, where `f` is a
`jax.custom_jvp`, `jax.custom_vjp`, `eqx.filter_custom_jvp` or
`eqx.filter_custom_vjp` function, equal those of `f` on the array the Value
stands for, as functions of the Value's leaves. Every rule here gives twice the
true derivative, so a rule that is skipped (the primal differentiated instead)
gives a different answer and fails.

Every type runs with `jax.custom_jvp` and `jax.custom_vjp` by default; Equinox's
`filter_custom_jvp`/`filter_custom_vjp` (built on those two) run by default on
the types in `EQX_BY_DEFAULT`, one of each kind, and on the others as slow tests.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest
from helpers import tree_allclose
from jax import lax

import quaxlike
from quaxlike.lora import LoraArray, LoraConvKernel
from quaxlike.named import NamedArray
from quaxlike.quantized import (
    FakeQuantized,
    quantize_int4,
    quantize_int8,
    quantize_mx,
    quantize_nf4,
    quantize_nvfp4,
)
from quaxlike.sparse import BCOO
from quaxlike.structured import Diagonal, TriDiagonal
from quaxlike.symbolic.constant import Constant
from quaxlike.symbolic.zero import Zero
from quaxlike.units import m, Unitful


RTOL, ATOL = 1e-4, 1e-5


def _normal(seed, shape):
    return jr.normal(jr.key(seed), shape)


def _lora(stop_gradient: bool, weight=None):
    weight = _normal(1, (4, 64)) if weight is None else weight
    lora = LoraArray(weight, rank=2, key=jr.key(2), stop_gradient=stop_gradient)
    return eqx.tree_at(lambda v: v.b, lora, 0.1 * _normal(3, lora.b.shape))


def _bcoo():
    indices = jnp.array([[0, 1], [1, 3], [2, 0], [3, 63], [0, 40]])
    return BCOO(_normal(4, (5,)), indices, (4, 64))


def _structured(kind):
    if kind == "diagonal":
        return Diagonal(_normal(5, (64,)))
    return TriDiagonal(_normal(6, (63,)), _normal(7, (64,)), _normal(8, (63,)))


# name -> a function making the Value (a matrix of 64 columns).
TYPES = {
    "lora frozen": lambda: _lora(True),
    "lora trainable": lambda: _lora(False),
    "qlora int4": lambda: _lora(True, quantize_int4(_normal(1, (4, 64)))),
    "int8": lambda: quantize_int8(_normal(9, (4, 64))),
    "int4": lambda: quantize_int4(_normal(10, (4, 64))),
    "nf4": lambda: quantize_nf4(_normal(11, (4, 64))),
    "nf4 double quant": lambda: quantize_nf4(_normal(12, (4, 64)), double_quant=True),
    "diagonal": lambda: _structured("diagonal"),
    "tridiagonal": lambda: _structured("tridiagonal"),
    "sparse": _bcoo,
    "unitful": lambda: Unitful(_normal(13, (4, 64)), m),
    "zero": lambda: Zero((4, 64), jnp.float32),
    "named": lambda: NamedArray(_normal(14, (4, 64)), ("out", "in")),
    "constant": lambda: Constant(jnp.float32(0.3), (4, 64), jnp.float32),
    "mxfp4": lambda: quantize_mx(_normal(15, (4, 64)), format="mxfp4"),
    "nvfp4": lambda: quantize_nvfp4(_normal(16, (4, 64))),
    "fake-quantized int4": lambda: FakeQuantized(_normal(17, (4, 64)), bits=4, group_size=32),
}
# One type of each kind (low-rank, quantised under LoRA, sparse, symbolic, with
# units) for Equinox's wrappers in a default run; the others are slow tests.
EQX_BY_DEFAULT = ("lora frozen", "qlora int4", "sparse", "zero", "unitful")


def _cases(function_names):
    """(type, function) pairs, Equinox's wrappers on the other types marked slow."""
    return [
        pytest.param(
            t,
            f,
            marks=[pytest.mark.slow] if f.startswith("eqx.") and t not in EQX_BY_DEFAULT else [],
        )
        for t in TYPES
        for f in function_names
    ]


_dense = quaxlike.internal.array_for_derivatives


def _plain(y):
    # A quantity's number in its unit (m^3 here); any other Value's array.
    return y.array if isinstance(y, Unitful) else _dense(y) if isinstance(y, quaxlike.Value) else y


# --- the custom functions: (w @ x)^3 with rules giving twice its derivative ------


def _cube(w, x):
    return (w @ x) ** 3


def _twice_cube_tangent(w, x, tw, tx):
    wx = w @ x
    tangent = 0.0 if tw is None else tw @ x
    tangent = tangent if tx is None else tangent + w @ tx
    return 6 * wx**2 * tangent


@jax.custom_jvp
def jax_jvp_cube(w, x):
    return _cube(w, x)


@jax_jvp_cube.defjvp
def _jax_jvp_cube_rule(primals, tangents):
    (w, x), (tw, tx) = primals, tangents
    return jax_jvp_cube(w, x), _twice_cube_tangent(w, x, tw, tx)


@jax.custom_vjp
def jax_vjp_cube(w, x):
    return _cube(w, x)


def _jax_vjp_fwd(w, x):
    wx = w @ x
    return wx**3, (w, x, wx)


def _jax_vjp_bwd(residuals, g):
    w, x, wx = residuals
    h = 6 * wx**2 * g
    return jnp.outer(h, x), h @ w  # a dense cotangent for `w`, whatever its type


jax_vjp_cube.defvjp(_jax_vjp_fwd, _jax_vjp_bwd)


@eqx.filter_custom_jvp
def eqx_jvp_cube(w, x):
    return _cube(w, x)


@eqx_jvp_cube.def_jvp
def _eqx_jvp_cube_rule(primals, tangents):
    (w, x), (tw, tx) = primals, tangents
    out = eqx_jvp_cube(w, x)
    if tw is None and tx is None:
        return out, jnp.zeros_like(out)
    return out, _twice_cube_tangent(w, x, tw, tx)


@eqx.filter_custom_vjp
def eqx_vjp_cube(w, x):
    return _cube(w, x)


@eqx_vjp_cube.def_fwd
def _eqx_vjp_fwd(perturbed, w, x):
    wx = w @ x
    return wx**3, wx


@eqx_vjp_cube.def_bwd
def _eqx_vjp_bwd(wx, g, perturbed, w, x):
    return jnp.outer(6 * wx**2 * g, x)


# name -> (function, whether it has a forward-mode derivative)
FUNCTIONS = {
    "jax.custom_jvp": (jax_jvp_cube, True),
    "jax.custom_vjp": (jax_vjp_cube, False),
    "eqx.filter_custom_jvp": (eqx_jvp_cube, True),
    "eqx.filter_custom_vjp": (eqx_vjp_cube, False),
}


def _losses(function):
    def through_quaxify(value, x):
        return _plain(quaxlike.quaxify(function)(value, x)).sum()

    def on_dense(value, x):
        return function(_dense(value), x).sum()

    return through_quaxify, on_dense


def _tangents(value, seed):
    """Random tangents for the inexact leaves of `value` (None for the others)."""
    leaves, treedef = jtu.tree_flatten(eqx.filter(value, eqx.is_inexact_array))
    keys = jr.split(jr.key(seed), max(len(leaves), 1))
    return jtu.tree_unflatten(
        treedef, [jr.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)]
    )


def _inexact(tree):
    return eqx.filter(tree, eqx.is_inexact_array)


@pytest.mark.parametrize("type_name, function_name", _cases(list(FUNCTIONS)))
def test_grad_runs_the_rule(type_name, function_name):
    function, _ = FUNCTIONS[function_name]
    through_quaxify, on_dense = _losses(function)
    value, x = TYPES[type_name](), 0.1 * _normal(20, (64,))
    got = eqx.filter_grad(through_quaxify)(value, x)
    expected = eqx.filter_grad(on_dense)(value, x)
    assert tree_allclose(_inexact(got), _inexact(expected), rtol=RTOL, atol=ATOL)
    if function_name in ("jax.custom_jvp", "jax.custom_vjp"):  # under `jit` too
        got = eqx.filter_jit(eqx.filter_grad(through_quaxify))(value, x)
        assert tree_allclose(_inexact(got), _inexact(expected), rtol=RTOL, atol=ATOL)
    # The rule ran: the true derivative is half of it.
    true = eqx.filter_grad(lambda v, x: _cube(_dense(v), x).sum())(value, x)
    if any(jnp.any(leaf != 0) for leaf in jtu.tree_leaves(_inexact(true))):
        assert not tree_allclose(_inexact(got), _inexact(true), rtol=RTOL, atol=ATOL)


def _jvp_or_zero(f, primals, tangents):
    """`eqx.filter_jvp`, with a zero for the tangent it leaves out (`None`: the
    output does not depend on the inputs, as for a `Zero`)."""
    out, tangent = eqx.filter_jvp(f, primals, tangents)
    return out, jnp.zeros_like(out) if tangent is None else tangent


@pytest.mark.parametrize(
    "type_name, function_name", _cases([n for n, (_, fwd) in FUNCTIONS.items() if fwd])
)
def test_jvp_runs_the_rule(type_name, function_name):
    function, _ = FUNCTIONS[function_name]
    through_quaxify, on_dense = _losses(function)
    value, x = TYPES[type_name](), 0.1 * _normal(20, (64,))
    primals, tangents = (value, x), (_tangents(value, 21), _normal(22, (64,)))
    _, got = _jvp_or_zero(through_quaxify, primals, tangents)
    _, expected = _jvp_or_zero(on_dense, primals, tangents)
    assert jnp.allclose(got, expected, rtol=RTOL, atol=ATOL)
    _, true = _jvp_or_zero(lambda v, x: _cube(_dense(v), x).sum(), primals, tangents)
    assert jnp.allclose(got, 2 * true, rtol=RTOL, atol=ATOL)
    # Only `x` perturbed: the Value's tangent is a symbolic zero.
    _, got = jax.jvp(lambda x: through_quaxify(value, x), (x,), (tangents[1],))
    _, expected = jax.jvp(lambda x: on_dense(value, x), (x,), (tangents[1],))
    assert jnp.allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_issue_example_custom_jvp_with_lora():
    # The reproducer of issue 34, cause 1.
    @jax.custom_jvp
    def f(w, x):
        return w @ x

    @f.defjvp
    def f_jvp(p, t):
        (w, x), (_, tx) = p, t
        return f(w, x), 2 * (w @ tx)

    lora = LoraArray(jnp.eye(3), rank=1, key=jr.key(0))
    out = jax.jvp(lambda x: quaxlike.quaxify(f)(lora, x), (jnp.ones(3),), (jnp.ones(3),))[1]
    assert jnp.array_equal(out, jnp.full(3, 2.0))


def test_refusal_names_the_derivative_and_the_way_out():
    # A type whose array is not linear in its leaves and that refuses to become
    # dense cannot give a rule its tangent: an error says so.
    class Product(quaxlike.ArrayValue):
        structured_tangents = False
        a: jax.Array
        b: jax.Array

        def aval(self):
            return jax.core.ShapedArray(self.a.shape, self.a.dtype)

        def materialise(self):
            raise RuntimeError("Product refuses to materialise")

    value = Product(jnp.ones((4, 64)), jnp.ones((4, 64)))
    with pytest.raises(quaxlike.MaterialisationError) as info:
        eqx.filter_jvp(
            lambda v: quaxlike.quaxify(jax_jvp_cube)(v, jnp.ones(64)).sum(),
            (value,),
            (_tangents(value, 0),),
        )
    message = str(info.value)
    assert "custom_jvp_call" in message and "Product" in message
    assert "dense_for_derivatives" in message and "refuses to materialise" in message


# --- a LoRA convolution kernel: conv(x, K)^3, with rules giving twice its derivative


def _conv(kernel, x):
    return lax.conv(x, kernel, (1, 1), "SAME")


@jax.custom_jvp
def conv_jvp_cube(kernel, x):
    return _conv(kernel, x) ** 3


@conv_jvp_cube.defjvp
def _conv_jvp_cube_rule(primals, tangents):
    (kernel, x), (t_kernel, t_x) = primals, tangents
    y = _conv(kernel, x)
    return y**3, 6 * y**2 * (_conv(t_kernel, x) + _conv(kernel, t_x))


@jax.custom_vjp
def conv_vjp_cube(kernel, x):
    return _conv(kernel, x) ** 3


def _conv_vjp_fwd(kernel, x):
    y = _conv(kernel, x)
    return y**3, (kernel, x, y)


def _conv_vjp_bwd(residuals, g):
    kernel, x, y = residuals
    h = 6 * y**2 * g
    # Linear in the kernel: its cotangent does not depend on the kernel's value,
    # and is a dense array whatever the kernel's type.
    placeholder = jnp.zeros(kernel.shape, kernel.dtype)
    (ct_kernel,) = jax.vjp(lambda k: _conv(k, x), placeholder)[1](h)
    (ct_x,) = jax.vjp(lambda z: _conv(kernel, z), x)[1](h)
    return ct_kernel, ct_x


conv_vjp_cube.defvjp(_conv_vjp_fwd, _conv_vjp_bwd)


@pytest.mark.parametrize("stop_gradient", [True, False])
@pytest.mark.parametrize(
    "function", [conv_jvp_cube, conv_vjp_cube], ids=["custom_jvp", "custom_vjp"]
)
def test_conv_lora_runs_the_rule(function, stop_gradient):
    kernel = LoraConvKernel(
        _normal(30, (4, 3, 3, 3)), rank=2, key=jr.key(31), stop_gradient=stop_gradient
    )
    kernel = eqx.tree_at(lambda k: k.b, kernel, 0.1 * _normal(32, kernel.b.shape))
    x = 0.3 * _normal(33, (1, 3, 5, 5))
    through_quaxify, on_dense = _losses(function)
    got = eqx.filter_grad(through_quaxify)(kernel, x)
    expected = eqx.filter_grad(on_dense)(kernel, x)
    assert tree_allclose(_inexact(got), _inexact(expected), rtol=RTOL, atol=ATOL)
    true = eqx.filter_grad(lambda k, x: (_conv(_dense(k), x) ** 3).sum())(kernel, x)
    assert not tree_allclose(_inexact(got), _inexact(true), rtol=RTOL, atol=ATOL)
    if function is conv_jvp_cube:
        primals, tangents = (kernel, x), (_tangents(kernel, 34), _normal(35, x.shape))
        _, got = eqx.filter_jvp(through_quaxify, primals, tangents)
        _, expected = eqx.filter_jvp(on_dense, primals, tangents)
        assert jnp.allclose(got, expected, rtol=RTOL, atol=ATOL)


@eqx.filter_custom_jvp
def _twice_product(a, b):
    return a * b


@_twice_product.def_jvp
def _twice_product_jvp(primals, tangents):
    (a, b), (ta, tb) = primals, tangents
    tangent = 0.0 if ta is None else 2 * ta * b
    tangent = tangent if tb is None else tangent + 2 * a * tb
    return _twice_product(a, b), tangent


def test_symbolic_zero_rule_under_jit_with_each_argument():
    # One trace per derivative: the rule gets `None` for the unperturbed input.
    dense = quaxlike.DenseArrayValue
    a, b = jnp.arange(3.0), jnp.full(3, 3.0)

    def f(a, b):
        return quaxlike.quaxify(_twice_product)(dense(a), dense(b)).sum()

    assert jnp.array_equal(jax.jit(jax.grad(f, 0))(a, b), 2 * b)
    assert jnp.array_equal(jax.jit(jax.grad(f, 1))(a, b), 2 * a)
    # One traced program differentiated with respect to each argument in turn:
    # the rule, first called with `None` for `b`, cannot be called again with a
    # tangent for it; an error says so rather than giving another derivative.
    traced = jax.jit(f)
    assert jnp.array_equal(jax.grad(traced, 0)(a, b), 2 * b)
    # (JAX's leak checker, on for the suite, fails on the tracers the error's
    # traceback holds, with an error of its own.)
    with jax.check_tracer_leaks(False), pytest.raises(quaxlike.QuaxlikeError, match="symbolic"):
        jax.grad(traced, 1)(a, b)


@jax.custom_vjp
def _sine(x):
    return jnp.sin(x)


_sine.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))


@pytest.mark.parametrize("function", [jax.nn.relu, _sine], ids=["custom_jvp", "custom_vjp"])
def test_derivative_at_a_python_number(function):
    # JAX hands the rules a Python number it differentiates at as a typed scalar
    # (JAX's nn_test and lax_scipy_test do this through `check_grads`).
    def through_quaxify(x):
        return _plain(quaxlike.quaxify(function)(quaxlike.DenseArrayValue(x)))

    assert jax.grad(through_quaxify)(1.0) == jax.grad(function)(1.0)
    if function is jax.nn.relu:  # a custom_vjp function has no forward mode
        assert jax.jvp(through_quaxify, (1.0,), (1.0,)) == jax.jvp(function, (1.0,), (1.0,))


class _OnlyRules(quaxlike.ArrayValue):
    """Quax's test type: it refuses to materialise and lives on its rules."""

    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        raise NotImplementedError


@quaxlike.register(lax.cos_p)
def _cos_p_only_rules(x: _OnlyRules, **params):
    return _OnlyRules(lax.cos_p.bind(x.array, **params))


@quaxlike.register(lax.sin_p)
def _sin_p_only_rules(x: _OnlyRules, **params):
    return _OnlyRules(lax.sin_p.bind(x.array, **params))


@quaxlike.register(lax.mul_p)
def _mul_p_only_rules(x: _OnlyRules | jax.Array, y: _OnlyRules | jax.Array, **params):
    unwrap = lambda v: v.array if isinstance(v, _OnlyRules) else v  # noqa: E731
    return _OnlyRules(lax.mul_p.bind(unwrap(x), unwrap(y), **params))


@jax.custom_vjp
def _hundred_sine(x):
    return jnp.sin(x)


_hundred_sine.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda res, ct: (100.0 * res * ct,))


def test_custom_vjp_cotangent_of_the_same_type_needs_no_dense_array():
    # Quax main's test_custom_vjp: `bwd` returns a cotangent of the input's own
    # type (structured), whose leaves are the leaves' cotangents.
    x = jnp.arange(1.0, 4.0)
    grad = jax.grad(lambda v: quaxlike.quaxify(_hundred_sine)(v).array.sum())(_OnlyRules(x))
    assert isinstance(grad, _OnlyRules)
    assert jnp.allclose(grad.array, 100 * jnp.cos(x))
