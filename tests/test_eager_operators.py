"""Arithmetic operators on Values in eager code (`quaxify(f)(...)` called outside
any transformation): where every operation of the operator's program on the
Values would only materialise them, `QuaxTracer`'s operator methods apply the
operator to the dense arrays directly, without JAX's Python path for `jax.jit`
with tracer arguments (quaxlike/_higher_order/_eager_operators.py).

That is only allowed where it gives exactly what the ordinary path gives, so
every result here is compared bitwise with plain JAX on the materialised arrays,
and with the same operation taken through the ordinary path (under
`jax.disable_jit`-free conditions that turn the shortcut off). Whether the
shortcut was taken shows in its table of verdicts.
"""

import operator
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import materialise_tree, PassThrough, randn, tree_allclose

import quaxlike
from quaxlike._higher_order import _eager_operators
from quaxlike.lora import LoraArray
from quaxlike.structured import Diagonal
from quaxlike.symbolic.zero import Zero
from quaxlike.units import m, s, Unitful


OPERATORS = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
}


def _eager(fn):
    return quaxlike.quaxify(fn, check=False)


def _shortcuts_taken() -> int:
    """How many (operator, operand kinds, avals) the shortcut applies to."""
    return sum(applies for applies, _ in _eager_operators._applies.values())


def _fresh_dense():
    """A fresh Value type with no rules (so rules registered for it stay local to
    one test) that counts its materialisations."""

    class Counted(quaxlike.ArrayValue):
        array: jax.Array
        count = [0]

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            type(self).count[0] += 1
            return self.array

    return Counted


def _identical(out, expected):
    out = quaxlike.internal.materialise_value(out) if isinstance(out, quaxlike.Value) else out
    assert jax.typeof(out) == jax.typeof(expected)
    np.testing.assert_array_equal(out, expected)


# Every operator with a Value and with a number; every kind of other operand
# with one operator.
_CASES = [(name, kind) for name in OPERATORS for kind in ("value", "reflected")] + [
    ("add", kind) for kind in ("array", "float", "int", "numpy")
]


@pytest.mark.parametrize("name, other_kind", _CASES)
def test_operators_match_plain_jax_bitwise(name, other_kind):
    op = OPERATORS[name]
    counted = _fresh_dense()
    x = randn(0, (5,)) + 3.0
    y = randn(1, (5,)) + 4.0
    others = {
        "value": (counted(y), y),
        "array": (y, y),
        "float": (2.5, 2.5),
        "int": (3, 3),
        "numpy": (np.asarray(y), np.asarray(y)),
    }
    if other_kind == "reflected":
        fn, args, plain = (lambda a: op(2.5, a)), (), (lambda: op(2.5, x))
    else:
        other, plain_other = others[other_kind]
        fn, args, plain = (lambda a, b: op(a, b)), (other,), (lambda: op(x, plain_other))
    before = _shortcuts_taken()
    for _ in range(2):
        _identical(_eager(fn)(counted(x), *args), plain())
    assert _shortcuts_taken() == before + 1  # worked out once, then reused


def test_matmul_both_ways_and_weak_types():
    x = randn(2, (4,))
    w = randn(3, (4, 4))
    dx, dw = quaxlike.DenseArrayValue(x), quaxlike.DenseArrayValue(w)
    _identical(_eager(lambda a, b: a @ b)(dx, dw), x @ w)
    _identical(_eager(lambda a: w @ a)(dx), w @ x)  # `Array.__matmul__` goes first
    _identical(_eager(lambda a: a @ w)(dx), x @ w)
    half = quaxlike.DenseArrayValue(x.astype(jnp.float16))
    # A Python number is weakly typed: float16 stays float16.
    _identical(_eager(lambda a: a * 2.0)(half), x.astype(jnp.float16) * 2.0)
    _identical(_eager(lambda a: 2 + a)(half), 2 + x.astype(jnp.float16))


def test_one_verdict_for_every_python_number():
    x = randn(4, (3,))
    fn = _eager(lambda a, c: a * c)
    before = len(_eager_operators._applies)
    for c in (2.0, 3.0, -1.5):
        _identical(fn(quaxlike.DenseArrayValue(x), c), x * c)
    assert len(_eager_operators._applies) == before + 1


def _typed_cases():
    x = randn(5, (3,))
    w = randn(6, (3, 3))
    lora = LoraArray(w, rank=2, key=jax.random.key(0), allow_materialise=True)
    return {
        "zero+zero": (lambda a, b: a + b, Zero((3,), jnp.float32), Zero((3,), jnp.float32)),
        "zero*dense": (lambda a, b: a * b, Zero((3,), jnp.float32), quaxlike.DenseArrayValue(x)),
        "diagonal@dense": (lambda a, b: a @ b, Diagonal(x), quaxlike.DenseArrayValue(x)),
        "diagonal+diagonal": (lambda a, b: a + b, Diagonal(x), Diagonal(2 * x)),
        "unitful*unitful": (lambda a, b: a * b, Unitful(x, m), Unitful(x, s)),
        "unitful/number": (lambda a, b: a / b, Unitful(x, m), 2.0),
        "passthrough-array": (lambda a, b: a - b, PassThrough(x), x),
        "lora@array": (lambda a, b: a @ b, lora, x),
    }


@pytest.mark.parametrize("case", list(_typed_cases()))
def test_result_types_are_those_of_the_ordinary_path(case):
    fn, a, b = _typed_cases()[case]
    before = _shortcuts_taken()
    fast = _eager(fn)(a, b)
    if isinstance(fast, quaxlike.Value):
        assert _shortcuts_taken() == before  # a rule ran: no shortcut
    with jax.disable_jit():  # no shortcut: the ordinary path, op by op
        ordinary = quaxlike.quaxify(fn, check=True)(a, b)
    assert type(fast) is type(ordinary)
    assert tree_allclose(fast, ordinary)
    if not isinstance(fast, Unitful):  # refuses to drop its unit
        expected = fn(*materialise_tree((a, b)))
        np.testing.assert_allclose(materialise_tree(fast), expected, rtol=1e-6, atol=1e-6)


def test_a_type_with_its_own_jit_rule_takes_the_ordinary_path():
    # Unitful registers its own `jit` rule (it tracks the values known while
    # tracing: a Python zero fits every unit, a traced zero is unknown), so the
    # shortcut, which needs the built-in rule, is not taken.
    x = randn(5, (3,))
    before = _shortcuts_taken()
    product = _eager(lambda a, b: a * b)(Unitful(x, m), Unitful(x, s))
    halved = _eager(lambda a: a / 2.0)(Unitful(x, m))
    shifted = _eager(lambda a: a + 0.0)(Unitful(x, m))
    assert _shortcuts_taken() == before
    assert product.unit == m * s and tree_allclose(product.array, x * x)
    assert halved.unit == m and tree_allclose(halved.array, x / 2.0)
    assert shifted.unit == m and tree_allclose(shifted.array, x)


def test_distinct_avals_get_distinct_verdicts():
    fn = _eager(lambda a, b: a + b)
    before = len(_eager_operators._applies)
    for shape in [(2,), (3,), (2, 2)]:
        x = randn(7, shape)
        _identical(fn(quaxlike.DenseArrayValue(x), x), x + x)
    assert len(_eager_operators._applies) == before + 3


def test_shape_errors_are_jax_s():
    a = quaxlike.DenseArrayValue(randn(8, (3,)))
    with pytest.raises(TypeError, match="add got incompatible shapes"):
        _eager(lambda a, b: a + b)(a, randn(9, (4,)))


def test_operands_jax_would_refuse():
    a = quaxlike.DenseArrayValue(randn(10, (3,)))
    with pytest.raises(TypeError):
        _eager(lambda a: a + "text")(a)
    with pytest.raises(TypeError):
        _eager(lambda a: a + [1.0, 2.0, 3.0])(a)


def test_a_rule_registered_later_is_used():
    counted = _fresh_dense()
    x, y = randn(11, (3,)), randn(12, (3,))
    fn = _eager(lambda a, b: a * b)
    _identical(fn(counted(x), y), x * y)

    @quaxlike.register(jax.lax.mul_p)
    def mul_p_counted_array(a: counted, b: jax.Array, **params):  # pyright: ignore
        return a.array * b + 1.0

    np.testing.assert_allclose(fn(counted(x), y), x * y + 1.0, rtol=1e-6)


# --- where the shortcut must not be taken --------------------------------------


def _not_taken(fn, *args):
    before = _shortcuts_taken()
    out = fn(*args)
    assert _shortcuts_taken() == before
    return out


def test_a_user_jit_rule_for_their_type_wins():
    counted = _fresh_dense()
    seen = []

    @quaxlike.register(jax.extend.core.primitives.jit_p)
    def jit_p_counted(*args: counted | jax.Array | float, jaxpr, **params):  # pyright: ignore
        seen.append(params["name"])
        arrays = [a.array if isinstance(a, counted) else a for a in args]
        return jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *arrays)

    x = randn(13, (3,))
    out = _not_taken(_eager(lambda a: a + 1.0), counted(x))
    _identical(out[0] if isinstance(out, list) else out, x + 1.0)
    assert seen  # the user's rule ran


def test_warn_policy_reports_every_call():
    counted = _fresh_dense()
    x = randn(14, (3,))
    fn = _eager(lambda a: a + 1.0)
    with quaxlike.materialise_policy("warn"):
        for _ in range(2):
            with pytest.warns(UserWarning, match="Counted"):
                _identical(_not_taken(fn, counted(x)), x + 1.0)


def test_explain_sees_every_operation():
    x = randn(15, (3,))
    report = quaxlike.explain(lambda a: a * 2.0)(quaxlike.DenseArrayValue(x))
    assert report.primitive_counts["mul"] == 1


def test_inside_a_transformation_within_the_function():
    x, y = randn(16, (3,)), randn(17, (3,))

    def fn(a, b):
        # `a * 2.0` happens under grad's trace, not directly in quaxify's.
        return jax.grad(lambda t: jnp.sum(a * 2.0 * t))(b)

    _identical(_not_taken(_eager(fn), quaxlike.DenseArrayValue(x), y), 2.0 * x)


def test_numpy_scalars():
    x = randn(26, (3,))
    out = _eager(lambda a, c: a * c)(quaxlike.DenseArrayValue(x), np.float32(2))
    _identical(out, x * np.float32(2))


def test_under_disable_jit():
    x = randn(18, (3,))
    with jax.disable_jit():
        _identical(_not_taken(_eager(lambda a: a / 4.0), quaxlike.DenseArrayValue(x)), x / 4.0)


def test_not_eager_at_all():
    x = randn(19, (3,))
    fn = jax.jit(_eager(lambda a: a * 3.0))
    _identical(_not_taken(fn, quaxlike.DenseArrayValue(x)), x * 3.0)
    grads = _not_taken(
        jax.grad(lambda v: jnp.sum(_eager(lambda a: a * a)(v))), quaxlike.DenseArrayValue(x)
    )
    np.testing.assert_allclose(grads.array, 2 * x, rtol=1e-6)


def test_values_of_another_trace():
    # An outer eager quaxify lifts `a`; an inner one (a rule redispatching, or
    # nesting by filter_spec) lifts `b`: `a + b` involves two traces.
    x, y = randn(20, (3,)), randn(21, (3,))
    counted = _fresh_dense()

    def outer(a, b):
        return quaxlike.quaxify(lambda b: a + b, filter_spec=lambda v: isinstance(v, counted))(b)

    out = _eager(outer)(quaxlike.DenseArrayValue(x), counted(y))
    _identical(out, x + y)


def test_a_value_made_inside_keeps_its_own_operators():
    reflected = []

    class Marked(quaxlike.ArrayOperators, quaxlike.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.array

        def __rmul__(self, other):
            reflected.append(type(other).__name__)
            return super().__rmul__(other)

    @quaxlike.register(jax.lax.mul_p)
    def mul_p_array_marked(a: jax.Array, b: Marked, **params):  # pyright: ignore
        return Marked(a * b.array)

    x, y = randn(24, (3,)), randn(25, (3,))

    def fn(v):
        # `Marked` was not lifted by this quaxify: JAX's `v * marked` declines
        # it, and `Marked.__rmul__` (which quaxifies on its own) decides.
        return v * Marked(y)

    out = _eager(fn)(quaxlike.DenseArrayValue(x))
    assert reflected == ["QuaxTracer"]
    assert isinstance(out, Marked)
    _identical(out.array, x * y)


def test_materialise_computes_eagerly_as_the_ordinary_path_does():
    class Scaled(quaxlike.ArrayValue):
        array: jax.Array
        factor: float = eqx.field(static=True)

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.factor * self.array

    x = randn(22, (3,))
    fn = _eager(lambda a: a + 1.0)
    for factor in (2.0, 3.0, 2.0):
        _identical(fn(Scaled(x, factor)), factor * x + 1.0)


def test_a_type_that_refuses_to_materialise_is_named_with_the_operation():
    lora = LoraArray(randn(27, (3, 3)), rank=1, key=jax.random.key(1))
    with pytest.raises(quaxlike.MaterialisationError, match=r"(?s)`add`.*LoraArray"):
        _eager(lambda a: a + 1.0)(lora)


def test_unhashable_fields():
    class Tagged(quaxlike.ArrayValue):
        array: jax.Array
        tags: list = eqx.field(static=True)

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.array * len(self.tags)

    x = randn(23, (3,))
    fn = _eager(lambda a: a + 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox, about an unhashable static field
        for tags in ([1], [1, 2], [1]):
            _identical(fn(Tagged(x, tags)), len(tags) * x + 1.0)
