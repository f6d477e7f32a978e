"""MX and NVFP4 weights placed by the logical spec of the array they stand for, on
8 devices: each leaf where the type declares (`quaxlike.leaf_specs`), the same
values as on one device, and products (forward and backward) under explicit
mesh axes equal to the dense weight's. Run through `tests/test_multidevice.py`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest
from helpers import randn, tree_allclose
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.quantized import MicroscaledArray, quantize_mx, quantize_nvfp4


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: run through tests/test_multidevice.py"
)


def _lora(w):
    lora = LoraArray(w, rank=2, key=jr.key(0))
    return eqx.tree_at(lambda v: v.b, lora, randn(1, lora.b.shape))


def _dense(v):
    if isinstance(v, LoraArray):
        assert isinstance(v.w, MicroscaledArray)
        return v.w.dequantize() + quaxlike.quaxify(lambda a, b: a @ b)(v.a, v.b)
    return v.dequantize()


# (name, build, logical spec). Columns split whole blocks: 16 blocks of a row over 8
# devices.
CASES = [
    ("mxfp8 rows", lambda: quantize_mx(randn(0, (16, 64))), P("x")),
    ("mxfp4 columns", lambda: quantize_mx(randn(0, (16, 512)), format="mxfp4"), P(None, "x")),
    ("nvfp4 rows", lambda: quantize_nvfp4(randn(0, (16, 64))), P("x")),
    ("nvfp4 columns", lambda: quantize_nvfp4(randn(0, (16, 256))), P(None, "x")),
    ("nvfp4 stack of layers", lambda: quantize_nvfp4(randn(0, (8, 4, 32))), P("x")),
    ("nvfp4 transposed", lambda: quantize_nvfp4(randn(0, (16, 64))).swapped(), P(None, "x")),
    ("qlora mxfp4 rows", lambda: _lora(quantize_mx(randn(0, (16, 64)), format="mxfp4")), P("x")),
]


@pytest.mark.parametrize("name, build, spec", CASES, ids=[c[0] for c in CASES])
def test_placed_by_logical_spec(name, build, spec):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    value = build()
    dense = _dense(value)
    sharding = NamedSharding(mesh, spec)
    placed = quaxlike.device_put(value, sharding)
    specs = quaxlike.leaf_specs(value, spec, mesh)
    for leaf, leaf_spec in zip(
        jtu.tree_leaves(placed), jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    ):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, leaf_spec), leaf.ndim)
    shardings = quaxlike.leaf_shardings(value, sharding)
    same = jax.jit(lambda v: v, in_shardings=(shardings,), out_shardings=shardings)(placed)
    assert tree_allclose(_dense(same), dense)
    assert tree_allclose(jax.jit(_dense)(placed), dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: quantize_mx(randn(6, (256, 512))),
        lambda: quantize_mx(randn(7, (256, 512)), format="mxfp4"),
        lambda: quantize_nvfp4(randn(8, (256, 512))),
    ],
    ids=["mxfp8", "mxfp4", "nvfp4"],
)
@pytest.mark.parametrize("spec", [P("x", None), P(None, "x")], ids=["rows", "columns"])
def test_products_under_explicit_mesh_axes(make, spec):
    explicit = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    q = make()
    dense = q.dequantize()
    x = randn(9, (16, 512))
    with jax.set_mesh(explicit):
        placed = quaxlike.device_put(q, NamedSharding(explicit, spec))
        xs = jax.device_put(x, NamedSharding(explicit, P()))

        def loss(x, q):
            return jnp.sum(jnp.tanh(x @ q.T))

        out = jax.jit(quaxlike.quaxify(lambda q, x: x @ q.T))(placed, xs)
        grad = jax.jit(jax.grad(quaxlike.quaxify(loss)))(xs, placed)
    assert jnp.allclose(out, x @ dense.T, atol=1e-3, rtol=1e-4)
    assert jnp.allclose(grad, jax.grad(loss)(x, dense), atol=1e-3, rtol=1e-4)
