"""Values created inside a quaxified function, and runtime type-checking of
functions that receive Values.

The rule: a Value created inside a quaxified function is not lifted by the
`quaxify` already running (it did not exist when that call lifted its
arguments). It joins dispatch through a `quaxify` opened where it is used:
its own operators (`quaxlike.ArrayOperators`), a `quaxlike.numpy` function, or an
explicit `quaxify`. That trace is the innermost one, so the new Value's rules
run first; the enclosing trace's tracers look like arrays to them, and any
operation on those goes on to the enclosing trace's rules.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from helpers import PassThrough, randn, tree_allclose
from jaxtyping import Array, Float, jaxtyped

import quaxlike
import quaxlike.numpy as qnp
from quaxlike.lora import LoraArray
from quaxlike.symbolic.zero import Zero


class Ones(quaxlike.ArrayOperators, quaxlike.ArrayValue):
    """All ones, stored as nothing; knows `x * 1 = x`, nothing else."""

    shape_: tuple[int, ...] = eqx.field(static=True)

    def aval(self):
        return jax.core.ShapedArray(self.shape_, jnp.float32)

    def materialise(self):
        raise RuntimeError("Ones never materialises in these tests")


@quaxlike.register(jax.lax.mul_p)
def mul_p_ones_any(x: Ones, y: quaxlike.ArrayValue | jax.Array, **params):
    return jnp.broadcast_to(y, jnp.broadcast_shapes(x.shape_, jnp.shape(y)))


@pytest.mark.parametrize("jit", [False, True])
def test_value_built_from_a_traced_shape_meets_a_traced_array(jit):
    def f(x):
        ones = Ones(x.shape)  # built inside, from the traced input's shape
        return ones * x + 1.0

    x = randn(0, (2, 3))
    run = jax.jit(quaxlike.quaxify(f)) if jit else quaxlike.quaxify(f)
    assert tree_allclose(run(x), x + 1.0)


def test_value_built_inside_meets_the_enclosing_traces_values():
    # `ones * v`: the Ones rule runs in the inner trace; `v` is a PassThrough
    # tracer of the enclosing trace, and broadcasting it goes to that trace.
    def f(v):
        return Ones(v.shape) * v, v * Ones(v.shape)

    x = randn(0, (3,))
    left, right = quaxlike.quaxify(f)(PassThrough(x))
    assert isinstance(left, PassThrough) and isinstance(right, PassThrough)
    assert tree_allclose((left.array, right.array), (x, x))


def test_value_built_inside_through_the_numpy_namespace():
    def f(x):
        zero = Zero(x.shape, x.dtype)
        return qnp.multiply(zero, x), qnp.add(zero, x)

    x = randn(0, (4,))
    product, total = jax.jit(quaxlike.quaxify(f))(x)
    assert isinstance(product, Zero) and product.shape == (4,)
    assert tree_allclose(total, x)


def test_lora_assembled_from_traced_factors_inside():
    w, a, b, x = randn(0, (5, 4)), randn(1, (5, 2)), randn(2, (2, 4)), randn(3, (4,))
    template = LoraArray(w, rank=2, key=jax.random.key(0))

    def f(a, b, x):
        lora = eqx.tree_at(lambda v: (v.a, v.b), template, (a, b))
        # Redispatch explicitly: the LoraArray joins an inner quaxify.
        return quaxlike.quaxify(lambda m, v: m @ v)(lora, x)

    out = jax.jit(f)(a, b, x)
    assert tree_allclose(out, (w + a @ b) @ x, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda a, b: f(a, b, x).sum(), argnums=(0, 1))(a, b)
    expected = jax.grad(lambda a, b: ((w + a @ b) @ x).sum(), argnums=(0, 1))(a, b)
    assert tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)


# --- runtime type-checking -------------------------------------------------------------


@jaxtyped(typechecker=beartype)
def _matvec(m: Float[Array, "n k"], v: Float[Array, " k"]) -> Float[Array, " n"]:  # noqa: F722
    return m @ v


@pytest.mark.parametrize(
    "make",
    [
        lambda: PassThrough(randn(0, (3, 4))),
        lambda: Zero((3, 4), jnp.float32),
        lambda: LoraArray(randn(0, (3, 4)), rank=2, key=jax.random.key(0)),
    ],
    ids=["pass_through", "zero", "lora"],
)
def test_jaxtyped_functions_accept_values_inside_quaxify(make):
    value, v = make(), randn(1, (4,))
    out = quaxlike.quaxify(_matvec)(value, v)
    assert tree_allclose(
        quaxlike.internal.materialise_value(out) if isinstance(out, quaxlike.Value) else out,
        _matvec(_dense(value), v),
        rtol=1e-5,
    )
    assert jax.jit(quaxlike.quaxify(_matvec))(value, v).shape == (3,)


def _dense(value):
    if isinstance(value, LoraArray):
        return value.w + value.a @ value.b
    return quaxlike.internal.materialise_value(value)


def test_jaxtyped_checks_still_catch_wrong_shapes_and_dtypes():
    v = randn(1, (4,))
    with pytest.raises(Exception, match="Type-check error"):
        quaxlike.quaxify(_matvec)(Zero((3, 5), jnp.float32), v)
    with pytest.raises(Exception, match="Type-check error"):
        quaxlike.quaxify(_matvec)(Zero((3, 4), jnp.int32), v)
