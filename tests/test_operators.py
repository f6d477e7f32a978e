"""The `ArrayOperators` mixin: operators, methods and properties on Values,
compared with the same operations on the materialised arrays."""

import operator

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import materialise_tree, PassThrough, randn, tree_allclose

import quaxlike
import quaxlike.numpy as qnp
from quaxlike import ArrayOperators
from quaxlike.lora import LoraArray
from quaxlike.symbolic.zero import Zero


# --- Value types with operators ---------------------------------------------------


class OpPassThrough(ArrayOperators, PassThrough):
    """Like `PassThrough`, but results are `OpPassThrough`s, so operators chain."""

    @staticmethod
    def default(primitive, values, params):
        arrays = [v.array if isinstance(v, PassThrough) else v for v in values]
        out = primitive.bind(*arrays, **params)
        if primitive.multiple_results:
            return [OpPassThrough(o) for o in out]
        return OpPassThrough(out)


class OpZero(ArrayOperators, Zero):
    pass


class StrictZero(ArrayOperators, Zero):
    """A Zero that refuses to materialise: an operation that succeeds on it
    provably ran a rule rather than the dense fallback."""

    def materialise(self):
        raise RuntimeError("StrictZero must not be materialised")


class OpLora(ArrayOperators, LoraArray):
    pass


def dense(x):
    return materialise_tree(x)


def make_lora(seed, m=3, n=4, rank=2, allow_materialise=False):
    w = randn(seed, (m, n))
    lora = OpLora(w, rank=rank, allow_materialise=allow_materialise, key=jax.random.key(0))
    # A nonzero `b`, so that the low-rank part shows in every result.
    lora = lora.with_factors(w, randn(seed + 1, (m, rank)), randn(seed + 2, (rank, n)))
    return lora, w + lora.a @ lora.b


def same(value_result, dense_result):
    """The result on Values, materialised, equals the result on arrays."""
    return tree_allclose(dense(value_result), dense_result)


# --- binary and unary operators ---------------------------------------------------
#
# Every operator call is one `quaxify` call (two, counting the `jit` inside the
# `jax.numpy` function), and with the tracer-leak checker on each of those runs a
# full garbage collection. So each operator is checked once or twice here, with
# the kinds of the other operand spread across them, rather than every
# combination.


def _other(kind, seed):
    if kind == "int":
        return 2
    if kind == "float":
        return 1.5
    if kind == "jax":
        return jnp.abs(randn(seed, (2,))) + 0.5  # broadcasts against (3, 2)
    if kind == "numpy":
        return np.abs(np.asarray(randn(seed, (3, 2)))) + 0.5
    return OpPassThrough(jnp.abs(randn(seed, (3, 2))) + 0.5)


# (operator, kind of the other operand forward, kind reflected)
_BINARY = [
    (operator.add, "int", "jax"),
    (operator.sub, "jax", "float"),
    (operator.mul, "value", "numpy"),
    (operator.truediv, "numpy", "int"),
    (operator.pow, "float", "value"),
    (operator.lt, "int", None),  # `2 < v` is `v > 2`: no reflected methods
    (operator.ne, "value", None),  # `==` is checked with the hashing below
]


@pytest.mark.parametrize("op, forward, reflected", _BINARY, ids=[op.__name__ for op, *_ in _BINARY])
@pytest.mark.loose_promotion  # operands of other dtypes and ranks, on purpose
def test_binary_operator(op, forward, reflected, getseed):
    x = jnp.abs(randn(getseed(), (3, 2))) + 0.5
    v = OpPassThrough(x)
    other = _other(forward, getseed())
    out = op(v, other)
    assert type(out) is OpPassThrough
    assert same(out, op(x, dense(other)))
    if reflected is not None:
        other = _other(reflected, getseed())
        out = op(other, v)
        assert type(out) is OpPassThrough
        assert same(out, op(dense(other), x))


def test_matmul_and_unary_operators(getseed):
    x = randn(getseed(), (3, 3))
    y = randn(getseed(), (3, 3))
    v = OpPassThrough(x)
    for out, expected in [(v @ y, x @ y), (y @ v, y @ x), (-v, -x), (abs(v), abs(x))]:
        assert type(out) is OpPassThrough
        assert same(out, expected)


def test_remaining_operators_under_jit(getseed):
    # `//`, `%` and `divmod` call jitted `jax.numpy` functions that are not inlined;
    # eagerly each call with a Value compiles anew (see test_namespaces), so they
    # are checked under one `jax.jit`, together with the integer operators.
    a = randn(getseed(), (3,))
    b = jnp.abs(randn(getseed(), (3,))) + 0.5
    i = jnp.array([1, 2, 7], dtype=jnp.int32)

    def remaining(a, b, ints):
        return [a // b, 2.5 % a, divmod(a, b), ints & 6, 1 << ints, ~ints]

    out = jax.jit(remaining)(OpPassThrough(a), b, OpPassThrough(i))
    leaves = jtu.tree_leaves(out, is_leaf=lambda t: isinstance(t, quaxlike.Value))
    assert len(leaves) == 7 and all(type(t) is OpPassThrough for t in leaves)
    assert same(out, remaining(a, b, i))


def test_unsupported_operand_gives_python_type_error():
    v = OpPassThrough(jnp.ones(3))
    with pytest.raises(TypeError, match="unsupported operand"):
        v + "text"  # noqa: B018
    # As for arrays, comparing with an unrelated object falls back to identity.
    assert (v == "text") is False


def test_numpy_arrays_use_the_reflected_operators(getseed):
    x = randn(getseed(), (3, 3))
    y = np.asarray(randn(getseed(), (3, 3)))
    v = OpPassThrough(x)
    out = y @ v
    assert type(out) is OpPassThrough and same(out, y @ x)
    # NumPy's own ufuncs are refused rather than silently materialising.
    with pytest.raises(TypeError, match="__array_ufunc__"):
        np.sin(v)


# --- indexing and the sequence protocol ---------------------------------------------


def test_getitem(getseed):
    x = randn(getseed(), (3, 4))
    v = OpPassThrough(x)
    indices = [(Ellipsis, slice(None, None, -2), None), np.array([True, False, True])]
    for index in indices:
        out = v[index]
        assert type(out) is OpPassThrough
        assert same(out, x[index])
    # An index that is itself a Value.
    assert same(v[OpPassThrough(jnp.array([2, 1]))], x[jnp.array([2, 1])])


def test_at_updates(getseed):
    x = randn(getseed(), (3, 4))
    y = randn(getseed(), (4,))
    v = OpPassThrough(x)
    for out, expected in [
        (v.at[1].set(OpPassThrough(y)), x.at[1].set(y)),  # the update may be a Value too
        (v.at[:, 2].add(1.0), x.at[:, 2].add(1.0)),
        (v.at[np.array([0, 2])].get(), x.at[np.array([0, 2])].get()),
    ]:
        assert type(out) is OpPassThrough
        assert same(out, expected)


def test_setitem_teaches_at(getseed):
    v = OpPassThrough(randn(getseed(), (3,)))
    with pytest.raises(TypeError, match=r"OpPassThrough.*immutable.*x\.at\[index\]\.set\(y\)"):
        v[0] = 1.0


def test_len_iter_reversed_contains(getseed):
    x = randn(getseed(), (3, 2))
    v = OpPassThrough(x)
    assert len(v) == 3
    rows = list(v)
    assert len(rows) == 3 and all(type(r) is OpPassThrough for r in rows)
    assert same(rows, list(x))
    assert same(list(reversed(v)), list(x[::-1]))
    column = OpPassThrough(x[:, 0])
    assert float(x[1, 0]) in column


def test_zero_dimensional_is_unsized_and_not_iterable():
    v = OpPassThrough(jnp.array(1.0))
    with pytest.raises(TypeError, match="len"):
        len(v)
    with pytest.raises(TypeError, match="0-d"):
        iter(v)


# --- methods and properties -----------------------------------------------------------

# A sample: every method goes through the same `_method` wrapper, so what is
# checked here is the forwarding of positional and keyword arguments and of
# results of other dtypes and shapes.
_METHODS = [
    ("sum", (), {"axis": 0, "keepdims": True}),
    ("mean", (1,), {}),
    ("argmax", (), {"axis": 1}),
    ("var", (), {"axis": 0, "ddof": 1}),
    ("reshape", ((2, -1),), {}),
    ("astype", (jnp.int32,), {}),
    ("take", (np.array([0, 2]),), {"axis": 1}),
]


def test_methods(getseed):
    x = randn(getseed(), (3, 4))
    v = OpPassThrough(x)
    for name, args, kwargs in _METHODS:
        out = getattr(v, name)(*args, **kwargs)
        assert type(out) is OpPassThrough, name
        assert same(out, getattr(x, name)(*args, **kwargs)), name


def test_every_method_is_a_jax_array_method():
    forwarded = [
        name
        for name, attr in vars(ArrayOperators).items()
        if not name.startswith("_") and (callable(attr) or isinstance(attr, property))
    ]
    assert len(forwarded) > 40
    concrete = jnp.zeros(())  # `tolist` is only on concrete arrays
    for name in forwarded:
        assert hasattr(jax.Array, name) or hasattr(concrete, name), name
    # They keep `jax.Array`'s docstrings.
    assert ArrayOperators.sum.__doc__ == jax.Array.sum.__doc__
    assert ArrayOperators.T.__doc__ == jax.Array.T.__doc__


def test_properties(getseed):
    x = randn(getseed(), (2, 3, 4))
    v = OpPassThrough(x)
    for name in ["T", "mT"]:
        out = getattr(v, name)
        assert type(out) is OpPassThrough
        assert same(out, getattr(x, name))
    # JAX builds the imaginary part of a real array as a constant, without the Value.
    assert same(v.imag, x.imag)
    assert v.itemsize == x.itemsize == 4
    assert (v.shape, v.dtype, v.ndim, v.size) == (x.shape, x.dtype, x.ndim, x.size)


def test_array_namespace():
    assert OpPassThrough(jnp.ones(2)).__array_namespace__() is qnp


# --- conversions ------------------------------------------------------------------------


def test_conversions_materialise():
    v = OpPassThrough(jnp.array(2.5))
    assert bool(v) is True and bool(OpPassThrough(jnp.array(0.0))) is False
    assert float(v) == 2.5 and int(v) == 2 and complex(v) == 2.5 + 0j
    assert [10, 20, 30, 40][OpPassThrough(jnp.array(2))] == 30  # __index__
    m = OpPassThrough(jnp.arange(6.0).reshape(2, 3))
    assert m.item(4) == 4.0 and m.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    array = np.asarray(m)
    assert isinstance(array, np.ndarray) and np.array_equal(array, np.arange(6.0).reshape(2, 3))
    assert np.asarray(m, dtype=np.int64).dtype == np.int64
    with pytest.raises(ValueError, match="ambiguous"):
        bool(m)  # as for an array of several elements


def test_conversion_of_a_value_that_refuses_to_materialise_teaches():
    z = StrictZero((), jnp.float32)
    with pytest.raises(quaxlike.MaterialisationError, match=r"`float\(\)`.*StrictZero.*must not"):
        float(z)
    with pytest.raises(quaxlike.MaterialisationError, match=r"`bool\(\)`"):
        bool(z)


def test_conversions_under_jit_fail_as_for_arrays():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(lambda v: bool(v))(OpPassThrough(jnp.array(1.0)))


# --- equality, hashing and PyTrees -------------------------------------------------------


def test_equality_is_elementwise_and_values_are_unhashable():
    x = jnp.array([1.0, 2.0, 3.0])
    v, w = OpPassThrough(x), OpPassThrough(jnp.array([1.0, 0.0, 3.0]))
    assert same(v == w, np.array([True, False, True]))
    with pytest.raises(TypeError, match="unhashable"):
        hash(v)
    with pytest.raises(TypeError, match="unhashable"):
        {v}  # noqa: B018
    # Structural comparison is still there, through Equinox:
    assert eqx.tree_equal(v, OpPassThrough(x))
    assert not eqx.tree_equal(v, w)
    # Without the mixin, Values keep Equinox's structural `==` and `hash`.
    assert Zero((2,), jnp.float32) == Zero((2,), jnp.float32)
    assert hash(Zero((2,), jnp.float32)) == hash(Zero((2,), jnp.float32))


class _Model(eqx.Module):
    zero: OpZero
    weight: OpPassThrough

    def __call__(self, a):
        return self.weight @ a + self.zero


def test_pytree_jit_and_filter_jit_still_work(getseed):
    x, y = randn(getseed(), (3, 2)), randn(getseed(), (2, 4))
    v = OpPassThrough(x)
    leaves, treedef = jtu.tree_flatten(v)
    assert type(jtu.tree_unflatten(treedef, leaves)) is OpPassThrough
    assert type(eqx.tree_at(lambda t: t.array, v, y)) is OpPassThrough
    assert repr(v) == "OpPassThrough(array=f32[3,2])"

    model = _Model(OpZero((3, 4), jnp.float32), v)
    out = jax.jit(lambda m, a: m(a))(model, y)
    assert type(out) is OpPassThrough and same(out, x @ y)
    out = eqx.filter_jit(model)(y)  # the model (holding Values) is the jitted callable
    assert type(out) is OpPassThrough and same(out, x @ y)


def test_vmap_and_grad(getseed):
    x = randn(getseed(), (5, 3))
    out = jax.vmap(lambda v: v.sum())(OpPassThrough(x))
    assert type(out) is OpPassThrough and same(out, x.sum(axis=1))
    grad = jax.grad(lambda v: (v * v).array.sum())(OpPassThrough(x))
    assert type(grad) is OpPassThrough and same(grad, 2 * x)


# --- results are what the rules decide: Zero and LoRA -------------------------------------


def test_zero_operators_never_materialise(getseed):
    z = StrictZero((3, 2), jnp.float32)
    x = randn(getseed(), (3, 2))
    y = randn(getseed(), (2, 4))
    results = {
        (3, 2): [2 * z, x * z, jax.jit(lambda a, b: a * b)(z, x)],
        (3, 4): [z @ y],
        (2, 2): [x.T @ z],
        (2, 3): [z.T],
        (2,): [z.sum(0)],
    }
    for shape, outs in results.items():
        for out in outs:
            assert isinstance(out, Zero) and out.shape == shape
    assert z.astype(jnp.int32).dtype == jnp.int32
    # `0 + x` is `x` itself, an array: the rule decides.
    out = x + z
    assert isinstance(out, jax.Array) and same(out, x)


def test_zero_falls_back_to_dense_where_no_rule(getseed):
    z = OpZero((3,), jnp.float32)
    x = randn(getseed(), (3,))
    out = jnp.exp(x) ** z  # `pow` with a Zero exponent: no rule, so materialised
    assert isinstance(out, jax.Array) and same(out, jnp.ones(3))


def test_lora_operators_never_materialise(getseed):
    lora, full = make_lora(getseed())
    x = randn(getseed(), (4, 2))
    assert same(lora @ x, full @ x)
    # Rules that keep the LoRA structure return `OpLora`s, which keep the operators
    # (`x.T @ negated` is `negated.__rmatmul__`, LoRA's dot rule again).
    negated = -lora.T
    assert type(negated) is OpLora
    assert same(x.T @ negated, -x.T @ full.T)


def test_lora_under_jit_and_grad(getseed):
    lora, full = make_lora(getseed())
    x = randn(getseed(), (4, 2))
    assert same(eqx.filter_jit(lambda m, a: m @ a)(lora, x), full @ x)

    def loss(m, a):
        return ((m @ a) ** 2).sum()

    grads = eqx.filter_grad(loss)(lora, x)
    expected_a, expected_b = jax.grad(
        lambda a, b: (((lora.w + a @ b) @ x) ** 2).sum(), argnums=(0, 1)
    )(lora.a, lora.b)
    assert type(grads) is OpLora
    assert same((grads.a, grads.b), (expected_a, expected_b))


# --- inside an enclosing quaxify --------------------------------------------------------------


def test_values_built_inside_quaxify(getseed):
    lora, full = make_lora(getseed())
    x = randn(getseed(), (4, 2))

    @quaxlike.quaxify
    def f(m, a):
        # `m` is a tracer of this trace: JAX's own operators, and LoRA's rules.
        mt = m.T  # another tracer (LoRA's transpose rule gives a LoraArray)
        h = m @ a  # an array (LoRA's dot rule gives one)
        z = StrictZero((4, 3), jnp.float32)  # a raw Value with the mixin
        p = OpPassThrough(jnp.ones((3, 2)))
        return [
            z + mt,  # the mixin, with a tracer of the enclosing trace as operand
            mt * z,  # tracer first: JAX defers to the mixin's __rmul__
            p * h,
            mt.shape,
        ]

    out = f(lora, x)
    # `0 + m.T` is the enclosing tracer itself, handed back out as the LoRA it wraps.
    assert type(out[0]) is OpLora and same(x.T @ out[0], x.T @ full.T)
    assert isinstance(out[1], Zero) and out[1].shape == (4, 3)
    assert type(out[2]) is OpPassThrough and same(out[2], full @ x)
    assert out[3] == (4, 3)


def test_value_holding_an_enclosing_tracer(getseed):
    x = randn(getseed(), (3,))

    @quaxlike.quaxify
    def f(a):
        # `a` is a tracer of this trace (it wraps a PassThrough); the new Value
        # holds it, and its operator opens a second trace on top of this one.
        return (OpPassThrough(a) * 2.0).array + 1.0

    out = f(PassThrough(x))
    assert type(out) is PassThrough and same(out, x * 2.0 + 1.0)


# --- opting in ----------------------------------------------------------------------------------


def test_values_without_the_mixin_have_no_operators():
    with pytest.raises(TypeError, match="unsupported operand"):
        Zero((2,), jnp.float32) * 2  # noqa: B018
    assert not hasattr(Zero((2,), jnp.float32), "sum")


def test_mixin_must_come_first():
    with pytest.raises(TypeError, match=r"\(quaxlike\.ArrayOperators, Zero\)"):

        class Late(Zero, ArrayOperators):
            pass


def test_mixin_needs_an_array_value():
    with pytest.raises(TypeError, match="not a `quaxlike.ArrayValue`"):

        class Shapeless(ArrayOperators, quaxlike.Value):
            def aval(self):
                raise NotImplementedError

            def materialise(self):
                raise NotImplementedError

    class Intermediate(ArrayOperators):  # another plain mixin: allowed
        pass

    class Negatable(Intermediate, PassThrough):
        pass

    out = -Negatable(jnp.ones(2))
    assert type(out) is PassThrough and same(out, -jnp.ones(2))
