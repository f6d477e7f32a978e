"""Tests for `quaxlike.symbolic.constant`: every rule against plain JAX on the
materialised array, and proof that Constants stay scalars."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import materialise_tree, randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.symbolic.constant import Constant
from quaxlike.symbolic.zero import Zero


def _static(value=2.0, shape=(3, 4), dtype=jnp.float32):
    return Constant(value, shape, dtype)


def _traced(value=2.0, shape=(3, 4), dtype=jnp.float32):
    return Constant(jnp.asarray(value, dtype), shape)


KINDS = {"static": _static, "traced": _traced}


@pytest.fixture
def no_materialise(monkeypatch):
    """Make every `Constant.materialise()` raise for the duration of the test."""

    def refuse(self):
        raise RuntimeError(f"Constant{self.shape} was materialised")

    monkeypatch.setattr(Constant, "materialise", refuse)


def _dense(c: Constant):
    return jnp.full(c.shape, c.value, c.dtype)


def _densify(tree):
    """Every Constant in `tree` as a full array, without calling `materialise()`."""
    is_constant = lambda v: isinstance(v, Constant)  # noqa: E731
    return jax.tree.map(lambda v: _dense(v) if is_constant(v) else v, tree, is_leaf=is_constant)


_CALLS = {"jit", "pjit", "closed_call"}


def _equations(jaxpr) -> list:
    """Every equation of `jaxpr` and of its sub-jaxprs; the calls that merely hold
    a sub-jaxpr (an inner `jax.jit`) are left out."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _CALLS:
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _equations(inner)
    return found


def _builds_array(eqn) -> bool:
    # A non-scalar result counts unless the equation only works on integer (or
    # boolean) arrays it was given (the index arithmetic of a gather, say); building an
    # array from a scalar, as materialising does, always counts.
    if all(v.aval.shape == () for v in eqn.outvars):
        return False
    integers = [
        jnp.issubdtype(v.aval.dtype, jnp.integer) or v.aval.dtype == jnp.bool_ for v in eqn.invars
    ]
    return not (all(integers) and any(v.aval.shape != () for v in eqn.invars))


def _only_scalar_equations(fn, *args) -> bool:
    """Whether the traced `fn` builds no full array (see `_builds_array`)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return not any(_builds_array(eqn) for eqn in _equations(jaxpr))


def _all(table):
    """One function computing every entry of `table`: the tests quaxify whole
    tables at once, since each quaxified call runs the tracer-leak checker (a
    garbage collection)."""
    return lambda *args: {name: fn(*args) for name, fn in table.items()}


def _primitive_names(fn, *args) -> list[str]:
    return [eqn.primitive.name for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr)]


# --- construction ---------------------------------------------------------------


def test_construction():
    c = Constant(2, (3,))
    assert c.is_static and c.dtype == jnp.int32 and c.shape == (3,) and c.value == 2
    assert Constant(np.int8(3)).dtype == np.int8
    assert Constant(0.1, (), jnp.float32).value == float(np.float32(0.1))
    t = Constant(jnp.float32(2.0), (2,))
    assert not t.is_static and t.dtype == jnp.float32
    assert Constant(jnp.asarray(2.0), (2,), static=True).is_static
    assert not Constant(2.0, (2,), jnp.bfloat16, static=False).is_static
    assert tree_allclose(materialise_tree(t), jnp.full((2,), 2.0))
    assert tree_allclose(materialise_tree(Constant(True, (2,))), jnp.ones(2, bool))
    with pytest.raises(ValueError, match="one scalar"):
        Constant(jnp.ones(3), (3,))
    with pytest.raises(ValueError, match="static=True"):
        jax.jit(lambda v: Constant(v, (2,), static=True).value)(1.0)


def test_static_values_compare_bit_for_bit():
    structure = lambda v: jax.tree.structure(Constant(v, (2,)))  # noqa: E731
    assert structure(float("nan")) == structure(float("nan"))
    assert structure(0.0) != structure(-0.0)
    # So `jax.jit` does not reuse the trace for 0.0 when given -0.0.
    f = jax.jit(quaxlike.quaxify(lambda c: 1.0 / c))
    assert f(Constant(0.0, (2,))).value == np.inf
    assert f(Constant(-0.0, (2,))).value == -np.inf


# --- elementwise ------------------------------------------------------------------

UNARY = {
    "neg": lambda c: -c,
    "exp_log": lambda c: jnp.log1p(jnp.exp(c)) + jnp.log(c),
    "trig": lambda c: jnp.sin(c) * jnp.cos(c) + jnp.arctan(c) + jnp.tanh(c),
    "sqrt": lambda c: jnp.sqrt(c) + lax.rsqrt(c) + jnp.cbrt(c),
    "special": lambda c: lax.lgamma(c) + lax.erf(c) + lax.logistic(c),
    "rounding": lambda c: jnp.floor(c * 1.3) + jnp.round(c * 1.7) + jnp.sign(-c),
    "powers": lambda c: c**3 + jnp.square(c) + c**-1,
    "convert": lambda c: (c.astype(jnp.int8), c.astype(jnp.bfloat16), c.astype(jnp.complex64)),
    "predicates": lambda c: (jnp.isfinite(c), c > 1.0, ~(c == 2.0)),
    "stop_gradient": lambda c: lax.stop_gradient(c),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unary(kind, no_materialise):
    c = KINDS[kind]()
    out = quaxlike.quaxify(_all(UNARY))(c)
    expected = jax.jit(_all(UNARY))(_dense(c))
    for name in UNARY:
        leaves = jax.tree.leaves(out[name], is_leaf=lambda v: isinstance(v, Constant))
        assert all(isinstance(leaf, Constant) for leaf in leaves), name
        assert all(leaf.is_static == (kind == "static") for leaf in leaves), name
        assert tree_allclose(_densify(out[name]), expected[name]), name
    # Static: nothing traced. Traced: scalar operations only, no full array.
    assert _only_scalar_equations(quaxlike.quaxify(_all(UNARY)), c)


def _arithmetic(a, b):
    return (
        a + b,
        a - b,
        a * b,
        a / b,
        a**b,
        jnp.maximum(a, b),
        jnp.minimum(a, b),
        jnp.arctan2(a, b),
        a < b,
        a == b,
        jnp.clip(a, b, a * a),
    )


def _binary(a, b):
    return (*_arithmetic(a, b), jnp.where(a > b, a, b))


@pytest.mark.parametrize("kinds", [("static", "static"), ("static", "traced")])
def test_binary_between_constants(kinds, no_materialise):
    a = KINDS[kinds[0]](1.5)
    b = KINDS[kinds[1]](-0.75, shape=(4,))  # broadcast against (3, 4)
    out = quaxlike.quaxify(_binary)(a, b)
    assert all(isinstance(o, Constant) for o in out)
    assert all(o.is_static == (kinds[1] == "static") for o in out)
    assert tree_allclose(_densify(out), jax.jit(_binary)(_dense(a), _dense(b)))
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(_binary))(a, b).jaxpr
    if kinds == ("static", "static"):
        assert _equations(jaxpr) == []
    assert _only_scalar_equations(quaxlike.quaxify(_binary), a, b)


def _integer_ops(a, b):
    return (
        a * b,
        a - b,
        lax.div(a, b),
        lax.rem(a, b),
        jnp.floor_divide(a, b),
        a >> 1,
        lax.shift_right_logical(a, b),
        a << 5,
        a & b,
        a | b,
        a ^ b,
    )


def test_integer_semantics(no_materialise):
    # Wrap-around, truncating division and shifts as JAX does them, not Python.
    cases = [(jnp.int8, 100, 3), (jnp.int32, -7, 2)]
    args = [(Constant(x, (2,), dtype), Constant(y, (2,), dtype)) for dtype, x, y in cases]
    out = quaxlike.quaxify(lambda args: [_integer_ops(a, b) for a, b in args])(args)
    expected = [_integer_ops(_dense(a), _dense(b)) for a, b in args]
    for results, references in zip(out, expected):
        assert all(isinstance(o, Constant) for o in results) and results[0].is_static
        for o, e in zip(results, references):
            assert np.array_equal(_dense(o), e) and o.dtype == e.dtype


def test_floating_semantics(no_materialise):
    def f(a, b):
        return a + b, a * a * a, a - 1.0

    for dtype, x, y in [
        (jnp.bfloat16, 1.0, 1 / 256),
        (jnp.float16, 300.0, 1e-2),
        (jnp.float32, 1e20, 1e20),
    ]:
        a, b = Constant(x, (2,), dtype), Constant(y, (2,), dtype)
        out = quaxlike.quaxify(f)(a, b)
        expected = f(_dense(a), _dense(b))
        assert all(
            np.array_equal(_dense(o), e) and o.dtype == e.dtype for o, e in zip(out, expected)
        )


# --- meeting dense arrays ------------------------------------------------------------

# fn(zero, one, x) for static Constants 0 and 1: each result is `x` itself.
IDENTITIES = {
    "x + 0": lambda zero, one, x: x + zero,
    "0 + x": lambda zero, one, x: zero + x,
    "x - 0": lambda zero, one, x: x - zero,
    "x * 1": lambda zero, one, x: x * one,
    "1 * x": lambda zero, one, x: one * x,
    "x / 1": lambda zero, one, x: x / one,
    "x ** 1": lambda zero, one, x: x**one,
    "x * broadcast 1": lambda zero, one, x: x * one[0],  # still a Constant
}


def test_identities(getseed, no_materialise):
    x, zero, one = randn(getseed(), (3, 4)), _static(0.0), _static(1.0)
    out = quaxlike.quaxify(_all(IDENTITIES))(zero, one, x)
    for name in IDENTITIES:
        assert tree_allclose(out[name], x), name
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(_all(IDENTITIES)))(zero, one, x).jaxpr
    assert _equations(jaxpr) == [] and jaxpr.outvars == jaxpr.invars * len(IDENTITIES)


def test_bitwise_identities(no_materialise):
    x = jnp.array([[True, False, True, False]] * 3)
    n = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    true, false = _static(True, dtype=bool), _static(False, dtype=bool)
    minus_one, zero = _static(-1, dtype=jnp.int32), _static(0, dtype=jnp.int32)
    for c, y, fn in [
        (true, x, lambda c, y: c & y),
        (false, x, lambda c, y: y | c),
        (false, x, lambda c, y: c ^ y),
        (minus_one, n, lambda c, y: y & c),
        (zero, n, lambda c, y: c | y),
    ]:
        jaxpr = jax.make_jaxpr(quaxlike.quaxify(fn))(c, y).jaxpr
        assert jaxpr.eqns == [] and jaxpr.outvars == jaxpr.invars
        assert tree_allclose(quaxlike.quaxify(fn)(c, y), fn(_dense(c), y))
    for c, y, fn in [
        (false, x, lambda c, y: c & y),
        (true, x, lambda c, y: y | c),
        (zero, n, lambda c, y: y & c),
        (minus_one, n, lambda c, y: c | y),
    ]:
        out = quaxlike.quaxify(fn)(c, y)
        assert isinstance(out, Constant) and out.is_static
        assert tree_allclose(_dense(out), fn(_dense(c), y))


def test_annihilators_and_negation(getseed, no_materialise):
    x = randn(getseed(), (3, 4))

    def f(zero, x):
        return x * zero, zero * x, x**zero

    zero = _static(0.0)
    out = quaxlike.quaxify(f)(zero, x)
    assert all(isinstance(o, Constant) and o.is_static for o in out)
    assert tree_allclose(_densify(out), f(_dense(zero), x))
    assert _equations(jax.make_jaxpr(quaxlike.quaxify(f))(zero, x).jaxpr) == []
    # 0 - x is -x: one negation.
    assert _primitive_names(quaxlike.quaxify(lambda z, x: z - x), zero, x) == ["neg"]
    assert tree_allclose(quaxlike.quaxify(lambda z, x: z - x)(zero, x), -x)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_scalar_operand_with_dense(kind, getseed):
    # Any other binary op takes the Constant as a rank-0 operand.
    x = randn(getseed(), (3, 4))
    c = KINDS[kind](1.5)
    out = quaxlike.quaxify(_binary)(c, x)
    assert tree_allclose(_densify(out), jax.jit(_binary)(_dense(c), x), rtol=1e-5)
    # Without a dense predicate choosing between the Constant and `x`, nothing is
    # built in full.
    assert "broadcast_in_dim" not in _primitive_names(quaxlike.quaxify(_arithmetic), c, x)
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda c, x: c * x - x / c))(c, x).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns] == ["mul", "div", "sub"]


def test_scalar_operand_with_size_one_axes(getseed):
    # `jnp.outer` multiplies `(n, 1)` by `(1, m)`: with a Constant on one side,
    # its scalar must still give the broadcast shape (found by the jnp table).
    v = randn(getseed(), (4,))
    c = Constant(1.5, (3,), jnp.float32)
    out = quaxlike.quaxify(jnp.outer)(c, v)
    assert tree_allclose(_densify(out), jnp.outer(jnp.full(3, 1.5), v))
    mask = quaxlike.quaxify(lambda c, v: c[:, None] == v[None, :])(c, v)
    assert mask.shape == (3, 4)


def test_select(getseed, no_materialise):
    x = randn(getseed(), (3, 4))
    c, d = _static(2.0), _static(-1.0)

    def f(c, d, x, p):
        return jnp.where(p, x, c), jnp.where(x > 0, c, c), lax.select_n(p, x, 2 * x)

    for p in [_static(True, dtype=bool), _static(False, dtype=bool)]:
        out = quaxlike.quaxify(f)(c, d, x, p)
        assert isinstance(out[1], Constant)
        assert tree_allclose(_densify(out), f(_dense(c), _dense(d), x, _dense(p)))
        names = _primitive_names(quaxlike.quaxify(f), c, d, x, p)
        assert "select_n" not in names and "broadcast_in_dim" not in names
    p = Constant(jnp.asarray(True), (3, 4))  # traced: a scalar predicate for select_n
    f = quaxlike.quaxify(lambda p, x: lax.select_n(p, x, 2 * x))
    assert tree_allclose(f(p, x), x * 2)
    assert "broadcast_in_dim" not in _primitive_names(f, p, x)


def test_with_zero(getseed):
    c, z = _static(2.0), Zero((3, 4), jnp.float32)

    def f(c, z):
        return c * z, z * c, c @ z.T, z - c, c + z, c - z

    out = quaxlike.quaxify(f)(c, z)
    assert [type(o) for o in out] == [Zero, Zero, Zero, Constant, Constant, Constant]
    assert tree_allclose(materialise_tree(out), f(_dense(c), jnp.zeros((3, 4))))


# --- shapes, indexing, reductions -------------------------------------------------

STRUCTURAL = {
    "broadcast": lambda c: jnp.broadcast_to(c, (2, 3, 4)),
    "reshape_transpose": lambda c: c.T.reshape(2, 6),
    "expand_squeeze_flip": lambda c: jnp.flip(jnp.squeeze(c[None], 0), 1),
    "slice": lambda c: c[1:, ::2],
    "dynamic_slice": lambda c: lax.dynamic_slice(c, (1, 1), (2, 3)),
    "gather": lambda c: c[jnp.array([2, 0])],
    "take_clip": lambda c: jnp.take(c, jnp.array([0, 9]), axis=1, mode="clip"),
    "split": lambda c: jnp.split(c, 2, axis=1),
    "concatenate": lambda c: jnp.concatenate([c, c[:1]]),
    "pad": lambda c: lax.pad(c, c[0, 0], [(1, 0, 1), (0, 2, 0)]),
    "update_slice": lambda c: lax.dynamic_update_slice(c, c[:2, :2], (1, 1)),
    "cummax": lambda c: lax.cummax(c, 1),
    "sum": lambda c: (jnp.sum(c), jnp.sum(c, axis=0)),
    "mean": lambda c: jnp.mean(c, axis=1),
    "max_min": lambda c: (jnp.max(c), jnp.min(c, axis=1)),
    "prod": lambda c: jnp.prod(c, axis=0),
    "argmax": lambda c: (jnp.argmax(c, axis=1), jnp.argmin(c)),
    "any_all": lambda c: (jnp.any(c > 1, axis=0), jnp.all(c > 1)),
    "xor_reduce": lambda c: lax.reduce_xor(c.astype(jnp.int32), (0,)),
    "matmul_constants": lambda c: (c @ c.T, jnp.einsum("ij,kj->", c, c + 1.0)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_structural_and_reductions(kind, no_materialise):
    c = KINDS[kind](2.0)
    out = quaxlike.quaxify(_all(STRUCTURAL))(c)
    expected = jax.jit(_all(STRUCTURAL))(_dense(c))
    for name in STRUCTURAL:
        leaves = jax.tree.leaves(out[name], is_leaf=lambda v: isinstance(v, Constant))
        assert all(isinstance(leaf, Constant) for leaf in leaves), name
        assert tree_allclose(_densify(out[name]), expected[name], rtol=1e-6), name
    assert _only_scalar_equations(quaxlike.quaxify(_all(STRUCTURAL)), c)


def test_static_program_has_no_equations(no_materialise):
    a, b = _static(1.25), _static(-0.5)

    def f(a, b):
        y = jnp.exp(a * b + a).T.reshape(2, 6)[1:]
        return jnp.sum(y, axis=1), a @ b.T, jnp.max(a * a), jnp.prod(b[0]), jnp.maximum(a, b)

    out = quaxlike.quaxify(f)(a, b)
    assert all(isinstance(o, Constant) and o.is_static for o in out)
    assert tree_allclose(_densify(out), jax.jit(f)(_dense(a), _dense(b)), rtol=1e-6)
    assert _equations(jax.make_jaxpr(quaxlike.quaxify(f))(a, b).jaxpr) == []


def test_reduction_edge_cases():
    # Integer sums wrap as JAX's do; empty reductions give the identity.
    c = Constant(100, (300,), jnp.int8)
    out = quaxlike.quaxify(lambda c: lax.reduce(c, np.int8(0), lax.add, (0,)))(c)
    assert isinstance(out, Constant)
    assert np.array_equal(_dense(out), lax.reduce(_dense(c), np.int8(0), lax.add, (0,)))
    empty = Constant(2.0, (0, 3), jnp.float32)

    def f(c):
        return jnp.sum(c, 0), jnp.prod(c, 0), lax.reduce_max(c, (0,)), lax.reduce_min(c, (0,))

    assert tree_allclose(materialise_tree(quaxlike.quaxify(f)(empty)), f(_dense(empty)))


def test_materialising_fallbacks(getseed):
    x = randn(getseed(), (3, 4))
    c = _static(2.0)

    def f(c, x):
        return (
            jnp.cumsum(c, 1),
            jnp.take(c, jnp.array([0, 9]), axis=1),  # fills with NaN out of bounds
            jnp.concatenate([c, c + 1.0]),
            lax.pad(c, np.float32(0.0), [(1, 0, 0), (0, 0, 0)]),
            jnp.concatenate([c, x]),
            jnp.where(x > 0, c, c - 3.0),
        )

    assert tree_allclose(materialise_tree(quaxlike.quaxify(f)(c, x)), jax.jit(f)(_dense(c), x))
    # (The check the other tests rely on does see a materialised Constant.)
    assert not _only_scalar_equations(quaxlike.quaxify(lambda c: jnp.cumsum(c, 1)), c)


# --- dot_general with dense arrays -----------------------------------------------------

DOTS = {
    "matvec": (lambda c, x: c @ x[:, 0], (3, 4), (4, 2)),
    "vecmat": (lambda c, x: x[:, 0] @ c, (4, 3), (4, 2)),
    "matmul": (lambda c, x: c @ x, (3, 4), (4, 2)),
    "rmatmul": (lambda c, x: x.T @ c, (4, 3), (4, 2)),
    "contract_first": (lambda c, x: jnp.einsum("ki,kj->ij", c, x), (4, 5), (4, 2)),
    "batched": (lambda c, x: jnp.einsum("bij,bjk->bik", c, x), (2, 3, 4), (2, 4, 5)),
    "batched_right": (lambda c, x: jnp.einsum("bji,bjk->bki", x, c), (2, 4, 3), (2, 4, 5)),
    "two_axes": (lambda c, x: jnp.einsum("ijk,jkl->il", x, c), (3, 4, 2), (5, 3, 4)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dot_general_with_dense(kind, getseed, no_materialise):
    cs = {name: KINDS[kind](-1.5, shape=c_shape) for name, (_, c_shape, _) in DOTS.items()}
    xs = {name: randn(getseed(), x_shape) for name, (_, _, x_shape) in DOTS.items()}

    def f(cs, xs):
        return {name: fn(cs[name], xs[name]) for name, (fn, _, _) in DOTS.items()}

    out = quaxlike.quaxify(f)(cs, xs)
    expected = jax.jit(f)({name: _dense(c) for name, c in cs.items()}, xs)
    for name in DOTS:
        assert tree_allclose(out[name], expected[name], rtol=1e-5, atol=1e-5), name
    assert "dot_general" not in _primitive_names(quaxlike.quaxify(f), cs, xs)


def test_dot_general_special_values(getseed, no_materialise):
    x = randn(getseed(), (4, 2)).astype(jnp.bfloat16)
    zero, one = _static(0.0, dtype=jnp.bfloat16), _static(1.0, dtype=jnp.bfloat16)
    out = quaxlike.quaxify(lambda c, x: c @ x)(zero, x)
    assert isinstance(out, Constant) and out.value == 0 and out.dtype == jnp.bfloat16
    f = lambda c, x: jnp.matmul(c, x, preferred_element_type=jnp.float32)  # noqa: E731
    out = quaxlike.quaxify(f)(one, x)
    assert tree_allclose(out, f(_dense(one), x), rtol=1e-5)
    assert "mul" not in _primitive_names(quaxlike.quaxify(f), one, x)


# --- transformations ------------------------------------------------------------


def _mixed(c, x):
    return jnp.sum(jnp.sin(c) * x) + jnp.sum(c @ x.T) + jnp.mean(c), c * 3.0 + 1.0


def test_jit(getseed, no_materialise):
    x = randn(getseed(), (3, 4))
    f, reference = jax.jit(quaxlike.quaxify(_mixed)), jax.jit(_mixed)
    for c in [_static(0.5), _traced(0.5), _traced(-2.0)]:
        total, const = f(c, x)
        assert isinstance(const, Constant)
        assert tree_allclose((total, _dense(const)), reference(_dense(c), x), rtol=1e-5)


def test_grad(getseed, no_materialise):
    x, c = randn(getseed(), (3, 4)), _traced(0.5)

    def reference(value, x):
        return _mixed(jnp.full((3, 4), value), x)[0]

    grad = jax.jit(jax.grad(lambda c, x: quaxlike.quaxify(_mixed)(c, x)[0], (0, 1)))
    grad_c, grad_x = grad(c, x)
    expected_c, expected_x = jax.jit(jax.grad(reference, (0, 1)))(jnp.float32(0.5), x)
    assert isinstance(grad_c, Constant) and not grad_c.is_static
    assert tree_allclose(grad_c.value, expected_c, rtol=1e-5)
    assert tree_allclose(grad_x, expected_x, rtol=1e-5)
    # With respect to the dense argument only, next to a static Constant.
    grad_x = jax.jit(jax.grad(lambda x: quaxlike.quaxify(_mixed)(_static(0.5), x)[0]))(x)
    assert tree_allclose(grad_x, expected_x, rtol=1e-5)


def test_vmap(getseed, no_materialise):
    values, xs = jnp.arange(5.0) - 2.0, randn(getseed(), (5, 3, 4))
    batch = jax.vmap(lambda v: Constant(v, (3, 4), jnp.float32))(values)
    total, const = jax.jit(jax.vmap(quaxlike.quaxify(_mixed)))(batch, xs)
    expected = jax.jit(jax.vmap(lambda v, x: _mixed(jnp.full((3, 4), v), x)))(values, xs)
    assert isinstance(const, Constant) and const.value.shape == (5,)
    assert tree_allclose(total, expected[0], rtol=1e-5)
    assert tree_allclose(jax.vmap(lambda c: _dense(c))(const), expected[1])
    # A static Constant shared by every element of the batch.
    total, _ = jax.jit(jax.vmap(quaxlike.quaxify(_mixed), in_axes=(None, 0)))(_static(0.5), xs)
    shared = jax.jit(jax.vmap(lambda x: _mixed(jnp.full((3, 4), 0.5), x)[0]))(xs)
    assert tree_allclose(total, shared, rtol=1e-5)


def _loops(c, x, p):
    carry, ys = lax.scan(lambda k, row: (k * 0.5, jnp.sum(k * row)), c[0], x)
    _, w = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, c))
    same = lax.cond(p, lambda: c * 1.0, lambda: c + 0.0)
    return carry, ys, w, same, lax.cond(p, lambda: c @ x.T, lambda: x @ c.T)


def test_control_flow(getseed, no_materialise):
    x = randn(getseed(), (3, 4))
    g, reference = jax.jit(quaxlike.quaxify(_loops)), jax.jit(_loops)
    c = _traced(1.5)
    for p in (True, False):
        out = g(c, x, p)
        # The scan and while carries and the cond result stay (traced) Constants.
        kinds = [Constant, jax.Array, Constant, Constant, jax.Array]
        assert all(isinstance(o, kind) for o, kind in zip(out, kinds))
        assert tree_allclose(_densify(out), reference(_dense(c), x, p), rtol=1e-5)


def test_control_flow_static_carry(getseed):
    # A static carry whose scalar changes each step cannot stay static: the loop
    # materialises it and gives what plain JAX gives.
    x = randn(getseed(), (3, 4))
    g, reference = jax.jit(quaxlike.quaxify(_loops)), jax.jit(_loops)
    c = _static(1.5)
    for p in (True, False):
        out = materialise_tree(g(c, x, p))
        assert tree_allclose(out, reference(_dense(c), x, p), rtol=1e-5)


# --- static scalar arithmetic ------------------------------------------------------

_VALUES = {
    jnp.int8: [-128, -7, -1, 0, 1, 2, 3, 100, 127],
    jnp.uint8: [0, 1, 3, 7, 128, 250, 255],
    jnp.int32: [-(2**31), -7, -1, 0, 1, 2, 5, 31, 40, 2**31 - 1],
    jnp.float16: [-np.inf, -1.5, -0.0, 0.0, 1e-3, 0.1, 1.0, 3.0, 300.0, 6.5e4, np.inf, np.nan],
    jnp.bfloat16: [-np.inf, -1.5, -0.0, 0.0, 1e-3, 0.1, 1.0, 3.0, 300.0, 3e38, np.inf, np.nan],
    jnp.float32: [-np.inf, -1.5, -0.0, 0.0, 1e-30, 0.1, 1.0, 3.0, 300.0, 3e38, np.inf, np.nan],
}

_STATIC_BINARY = {
    "add": lax.add_p,
    "sub": lax.sub_p,
    "mul": lax.mul_p,
    "div": lax.div_p,
    "rem": lax.rem_p,
    "max": lax.max_p,
    "min": lax.min_p,
    "eq": lax.eq_p,
    "lt": lax.lt_p,
}
_STATIC_INTEGER = {
    "and": lax.and_p,
    "or": lax.or_p,
    "xor": lax.xor_p,
    "shift_left": lax.shift_left_p,
    "shift_right_arithmetic": lax.shift_right_arithmetic_p,
    "shift_right_logical": lax.shift_right_logical_p,
}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        return False
    if jnp.issubdtype(a.dtype, jnp.floating) and np.isnan(a.astype(np.float32)):
        return bool(np.isnan(b.astype(np.float32)))
    return a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", list(_VALUES), ids=lambda d: np.dtype(d).name)
def test_static_scalars_match_jax(dtype):
    # The NumPy fast path for static scalars gives exactly what XLA gives, bit for
    # bit, wherever it answers (elsewhere JAX computes the scalar itself).
    from quaxlike.symbolic.constant import _scalars

    values = np.asarray(_VALUES[dtype], dtype=dtype)
    xs, ys = (a.ravel() for a in np.meshgrid(values, values))
    binary = dict(_STATIC_BINARY, **(_STATIC_INTEGER if jnp.issubdtype(dtype, jnp.integer) else {}))
    others = [d for d in _VALUES if d != dtype]

    def reference(xs, ys, values):
        out = {
            name: p.bind(xs, ys, **({"out_dtype": None} if p is lax.mul_p else {}))
            for name, p in binary.items()
        }
        out["neg"], out["abs"], out["square"] = -values, jnp.abs(values), values * values
        out["pow2"], out["pow3"] = lax.integer_pow(values, 2), lax.integer_pow(values, 3)
        for d in others:
            out[np.dtype(d).name] = lax.convert_element_type(values, d)
        if jnp.issubdtype(dtype, jnp.floating):
            out["floor"], out["ceil"], out["sqrt"] = (
                jnp.floor(values),
                jnp.ceil(values),
                jnp.sqrt(values),
            )
            out["round"], out["isfinite"] = jnp.round(values), jnp.isfinite(values)
        else:
            out["not"] = ~values
        return out

    unary = {
        "neg": (lax.neg_p, {}),
        "abs": (lax.abs_p, {}),
        "square": (lax.square_p, {}),
        "pow2": (lax.integer_pow_p, {"y": 2}),
        "pow3": (lax.integer_pow_p, {"y": 3}),
        "floor": (lax.floor_p, {}),
        "ceil": (lax.ceil_p, {}),
        "sqrt": (lax.sqrt_p, {}),
        "round": (lax.round_p, {"rounding_method": lax.RoundingMethod.TO_NEAREST_EVEN}),
        "isfinite": (lax.is_finite_p, {}),
        "not": (lax.not_p, {}),
        **{
            np.dtype(d).name: (lax.convert_element_type_p, {"new_dtype": np.dtype(d)})
            for d in others
        },
    }
    expected = jax.tree.map(np.asarray, jax.jit(reference)(xs, ys, values))
    checked = 0
    for name, results in expected.items():
        if name in binary:
            primitive, params, operands = binary[name], {}, list(zip(xs, ys))
        else:
            (primitive, params), operands = unary[name], [(x,) for x in values]
        for ops, result in zip(operands, results):
            got = _scalars.numpy_bind(primitive, [np.asarray(o) for o in ops], params)
            if got is not None:
                checked += 1
                assert _same(got, result), (name, ops, got, result)
    assert checked > 100
