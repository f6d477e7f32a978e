"""`explain` takes what `quaxify` takes: Equinox models, Flax parameter trees and
modules, keyword arguments, and leaves that are not arrays (activation
functions, Python numbers, modules). Each report's program is run on the array
leaves and compared with plain JAX on the merged weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest
from helpers import randn, tree_allclose

import quaxlike
from quaxlike.lora import LoraArray, loraify, merge


def _trained(model, seed=10):
    """Every LoraArray in `model` with a nonzero `B`, so that `W + A @ B`
    differs from `W` and a rule that forgot `A @ B` would be caught."""
    lora_leaves = [x for x in jtu.tree_leaves(model, is_leaf=_is_lora) if _is_lora(x)]
    new = [
        eqx.tree_at(lambda v: v.b, x, randn(seed + i, x.b.shape)) for i, x in enumerate(lora_leaves)
    ]
    return eqx.tree_at(
        lambda m: [x for x in jtu.tree_leaves(m, is_leaf=_is_lora) if _is_lora(x)], model, new
    )


def _is_lora(x):
    return isinstance(x, LoraArray)


def _run_program(report, *args, **kwargs):
    """Evaluate the report's program on the array leaves of the arguments, in the
    order `explain` traced them."""
    leaves = jtu.tree_leaves(eqx.filter((args, kwargs), eqx.is_array))
    return jax.extend.core.jaxpr_as_fun(report.jaxpr)(*leaves)


def test_explain_equinox_model_with_activation_leaf():
    mlp = eqx.nn.MLP(3, 2, 4, depth=2, key=jr.key(0))
    model = _trained(loraify(mlp, rank=1, key=jr.key(1)))
    x = randn(0, (3,))

    report = quaxlike.explain(lambda m, x: m(x))(model, x)

    assert report.primitive_counts["dot_general"] == 3
    assert all(
        r.handler.endswith("dot_general_p_lora_any")
        for r in report.walk()
        if r.primitive == "dot_general"
    )
    assert not report.materialised
    (out,) = _run_program(report, model, x)
    assert tree_allclose(out, merge(model)(x), rtol=1e-5, atol=1e-5)
    assert report.out_shape == jax.ShapeDtypeStruct((2,), jnp.float32)


def test_explain_model_as_the_function():
    model = _trained(loraify(eqx.nn.MLP(3, 2, 4, depth=1, key=jr.key(0)), rank=1, key=jr.key(1)))
    x = randn(1, (3,))
    report = quaxlike.explain(model)(x)
    assert report.primitive_counts["dot_general"] == 2 and not report.materialised
    (out,) = _run_program(report, x)
    assert tree_allclose(out, merge(model)(x), rtol=1e-5, atol=1e-5)


def test_explain_flax_linen_params_and_module_argument():
    linen = pytest.importorskip("flax.linen")

    class MLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(2)(linen.relu(linen.Dense(4)(x)))

    module = MLP()
    x = randn(2, (3,))
    params = module.init(jr.key(0), x)
    lora_params = _trained(loraify(params, rank=1, key=jr.key(1), where="**.kernel"))

    # The module itself is an argument: not an array, so passed as it is.
    report = quaxlike.explain(lambda mod, p, x: mod.apply(p, x))(module, lora_params, x)

    assert report.primitive_counts["dot_general"] == 2 and not report.materialised
    (out,) = _run_program(report, module, lora_params, x)
    assert tree_allclose(out, module.apply(merge(lora_params), x), rtol=1e-5, atol=1e-5)


def test_explain_flax_nnx_module():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    lora_layer = _trained(loraify(layer, rank=1, key=jr.key(1), where="kernel.value"))
    x = randn(3, (3,))

    report = quaxlike.explain(lambda m, x: m(x))(lora_layer, x)

    assert report.primitive_counts["dot_general"] == 1 and not report.materialised
    (out,) = _run_program(report, lora_layer, x)
    assert tree_allclose(out, merge(lora_layer)(x), rtol=1e-5, atol=1e-5)


def test_explain_keyword_arguments_and_static_leaves():
    lora = _trained(LoraArray(randn(4, (3, 4)), rank=2, key=jr.key(0)))
    x = randn(5, (4,))

    def layer(x, *, weight, activation, scale):
        return activation(weight @ x) * scale, "label"

    report = quaxlike.explain(layer)(x, weight=lora, activation=jax.nn.gelu, scale=2.0)

    (dot,) = [r for r in report.walk() if r.primitive == "dot_general"]
    assert dot.handler.endswith("dot_general_p_lora_any")
    # Non-array outputs are kept in `out_shape` as they are.
    assert report.out_shape == (jax.ShapeDtypeStruct((3,), jnp.float32), "label")
    (out,) = _run_program(report, x, weight=lora, activation=jax.nn.gelu, scale=2.0)
    expected = jax.nn.gelu((lora.w + lora.a @ lora.b) @ x) * 2.0
    assert tree_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_explain_abstract_arguments():
    lora = _trained(LoraArray(randn(6, (3, 4)), rank=2, key=jr.key(0)))
    report = quaxlike.explain(lambda w, x: w @ x)(lora, jax.ShapeDtypeStruct((4,), jnp.float32))
    assert report.out_shape == jax.ShapeDtypeStruct((3,), jnp.float32)
    x = randn(7, (4,))
    (out,) = _run_program(report, lora, x)
    assert tree_allclose(out, (lora.w + lora.a @ lora.b) @ x, rtol=1e-5, atol=1e-5)
