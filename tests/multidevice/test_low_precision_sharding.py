"""AWQ's `InputScaled` and `W8A8Array` weights placed on 8 devices by the
logical spec of the weight (`quaxlike.device_put`, `leaf_specs`): each leaf
where the type declares, and a model's outputs equal to one device's. Run
through `tests/test_multidevice.py`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import randn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.lora import loraify
from quaxlike.quantized import InputScaled, quantize, quantize_int4


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: run through tests/test_multidevice.py"
)


def awq(w, seed):
    s = jnp.exp(0.5 * randn(seed, (w.shape[-1],)))
    return InputScaled(quantize_int4(w * s, group_size=8), s)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(64, 16, 64, depth=2, key=jr.key(0))


def models(mlp):
    awq_model = eqx.tree_at(
        lambda m: [layer.weight for layer in m.layers],
        mlp,
        [awq(layer.weight, i) for i, layer in enumerate(mlp.layers)],
    )
    w8a8 = quantize(mlp, bits=8, activations=8)
    qlora = loraify(awq_model, rank=2, key=jr.key(1))
    return {"awq": awq_model, "w8a8": w8a8, "qlora over awq": qlora}


@pytest.mark.parametrize("kind", ["awq", "w8a8", "qlora over awq"])
@pytest.mark.parametrize("spec", [P("x"), P(None, "x")], ids=["rows", "columns"])
def test_models_placed_by_the_weights_logical_spec(mesh, mlp, kind, spec):
    model = models(mlp)[kind]
    is_weight = lambda x: isinstance(x, quaxlike.Value)  # noqa: E731
    shardings = jtu.tree_map(
        lambda x: NamedSharding(mesh, spec) if is_weight(x) else None, model, is_leaf=is_weight
    )
    placed = quaxlike.device_put(model, shardings)
    for layer, original in zip(placed.layers, model.layers):
        specs = quaxlike.leaf_specs(original.weight, spec, mesh)
        pairs = zip(
            jtu.tree_leaves(layer.weight),
            jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P)),
        )
        for leaf, leaf_spec in pairs:
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, leaf_spec), leaf.ndim)
    x = randn(2, (8, 64))
    run = eqx.filter_jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))
    np.testing.assert_allclose(run(placed, x), run(model, x), rtol=1e-5, atol=1e-5)
