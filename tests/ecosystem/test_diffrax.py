"""diffrax solves whose vector field holds Values (a LoRA'd MLP, a structured or
quantised matrix), forward, each against the same solve on the dense arrays, under
`eqx.filter_jit` (diffrax compiles `diffeqsolve` itself) and eagerly. (Gradients
with every adjoint are in `test_gradients.py`.)"""

import _ecosystem_values as _cases
import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import quaxlike
from quaxlike.lora import loraify


def lora_mlp(key):
    mlp = eqx.nn.MLP(_cases.N, _cases.N, 8, depth=1, activation=jnp.tanh, key=key)
    return mlp, loraify(mlp, rank=2, key=jr.fold_in(key, 1))


def solve(field, y0, *, adaptive=True, ts=None):
    """`dy/dt = field(y)` from 0 to 1 with Tsit5."""
    term = diffrax.ODETerm(lambda t, y, args: args(y))
    controller = (
        diffrax.PIDController(rtol=1e-5, atol=1e-5) if adaptive else diffrax.ConstantStepSize()
    )
    saveat = diffrax.SaveAt(ts=ts) if ts is not None else diffrax.SaveAt(t1=True)
    return diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        args=field,
        stepsize_controller=controller,
        saveat=saveat,
        max_steps=64,
    ).ys


class _MatVecField(eqx.Module):
    matrix: object

    def __call__(self, y):
        return -(self.matrix @ y)


def _matvec_field(matrix):
    return _MatVecField(matrix)


FIELDS = {
    "lora_mlp": lambda key: lora_mlp(key)[::-1],
    "lora": lambda key: (_matvec_field(m := _cases.lora_general(key)), _matvec_field(m.dense())),
    "tridiagonal": lambda key: (
        _matvec_field(m := _cases.tridiagonal(key)),
        _matvec_field(m.materialise()),
    ),
    "int8": lambda key: (
        _matvec_field(m := _cases.int8(key)),
        _matvec_field(_cases.dense_of(m)),
    ),
}


@pytest.mark.parametrize(
    "name, adaptive",
    [("lora_mlp", True), ("lora", False), ("tridiagonal", True), ("int8", False)],
)
def test_forward_solve(name, adaptive):
    field, dense_field = FIELDS[name](jr.key(0))
    y0 = jnp.linspace(-0.5, 0.5, _cases.N)
    ts = jnp.linspace(0.0, 1.0, 4)
    run = quaxlike.quaxify(lambda f, y: solve(f, y, adaptive=adaptive, ts=ts))
    expected = solve(dense_field, y0, adaptive=adaptive, ts=ts)
    # `diffeqsolve` compiles itself (`eqx.filter_jit`): called eagerly, and inside
    # an outer `filter_jit`.
    np.testing.assert_allclose(run(field, y0), expected, rtol=1e-5, atol=1e-6)
    if name == "lora_mlp":
        jitted = eqx.filter_jit(run)(field, y0)
        np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-6)


def test_nothing_is_materialised_in_a_lora_mlp_solve():
    field, _ = FIELDS["lora_mlp"](jr.key(0))
    report = quaxlike.explain(solve)(field, jnp.zeros(_cases.N))
    assert not report.materialised, report
