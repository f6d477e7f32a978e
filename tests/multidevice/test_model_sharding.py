"""A small QLoRA model (NF4 with double quantisation, stacked layers under
`lax.scan`) sharded as a user asks for it with `quaxlike.sharding`:
fully sharded data parallelism and tensor parallelism on 8 devices give the loss
and gradients of one device; FSDP gathers each layer's packed codes (`uint8`),
never a dequantised weight. Run through `tests/test_multidevice.py`.
"""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import tree_allclose
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.lora import partition, qlora
from quaxlike.selection import path
from quaxlike.sharding import columns, fsdp, gathered, model_shardings, rows, shard, stack_depths


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: run through tests/test_multidevice.py"
)

DIM, HIDDEN, LAYERS, BATCH = 128, 256, 2, 16


class Layer(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, DIM, use_bias=False, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.silu(self.up(x)))


class Model(eqx.Module):
    layers: Layer  # stacked: a leading axis of LAYERS
    gather_mesh: object = eqx.field(static=True, default=None)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, leaves):
            layer = eqx.combine(leaves, static)
            if self.gather_mesh is not None:
                layer = gathered(layer, self.gather_mesh)  # FSDP: this layer only
            return jax.vmap(layer)(h), None

        return lax.scan(body, x, dynamic)[0]


def _model():
    layers = eqx.filter_vmap(Layer)(jr.split(jr.key(0), LAYERS))
    model = qlora(
        Model(layers), bits="nf4", group_size=16, double_quant=True, rank=4, key=jr.key(1)
    )
    # Non-zero B factors, so that the gradients reach both factors. (Groups of
    # 16 inputs: second-level blocks of 32 and 16 rows, 8 of each per layer.)
    return eqx.tree_at(
        lambda m: (m.layers.up.weight.b, m.layers.down.weight.b),
        model,
        (
            0.1 * jr.normal(jr.key(2), model.layers.up.weight.b.shape),
            0.1 * jr.normal(jr.key(3), model.layers.down.weight.b.shape),
        ),
    )


def _loss(trainable, frozen, x, y):
    model = eqx.combine(trainable, frozen)
    return jnp.mean((quaxlike.quaxify(model)(x) - y) ** 2)


@pytest.fixture(scope="module", params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def mesh(request):
    # `Explicit` axes (JAX's default): every sharding is part of the type, and only
    # `reshard` changes one; `gathered` and the quantised products follow that.
    return jax.make_mesh((8,), ("data",), axis_types=(request.param,))


@pytest.fixture(scope="module")
def one_device():
    model = _model()
    x, y = jr.normal(jr.key(4), (BATCH, DIM)), jr.normal(jr.key(5), (BATCH, DIM))
    trainable, frozen = partition(model)
    loss, grads = jax.jit(jax.value_and_grad(_loss))(trainable, frozen, x, y)
    return model, x, y, loss, grads


def _sharded_step(model, mesh, rules, batch_spec):
    specs = model_shardings(model, mesh, rules)
    placed = quaxlike.device_put(model, specs)
    trainable, frozen = partition(placed)
    data = NamedSharding(mesh, batch_spec)
    step = jax.jit(jax.value_and_grad(_loss))
    return step, trainable, frozen, data


def test_fsdp_same_loss_and_gradients_and_gathers_packed_codes(mesh, one_device):
    model, x, y, loss, grads = one_device
    model = dataclasses.replace(model, gather_mesh=mesh)
    step, trainable, frozen, data = _sharded_step(model, mesh, [("**", fsdp(mesh))], P("data"))
    # Every quantised leaf is split: no device holds a whole weight.
    for leaf in jax.tree_util.tree_leaves(frozen):
        assert not leaf.sharding.is_fully_replicated, leaf.shape
    x, y = jax.device_put(x, data), jax.device_put(y, data)
    got_loss, got_grads = step(trainable, frozen, x, y)
    assert tree_allclose(got_loss, loss, rtol=1e-4, atol=1e-5)
    leaves = jax.tree_util.tree_leaves
    assert tree_allclose(leaves(got_grads), leaves(grads), rtol=1e-3, atol=1e-5)
    hlo = step.lower(trainable, frozen, x, y).compile().as_text()
    gathers = re.findall(r"= (\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
    gathered_types = {dtype for dtype, _ in gathers}
    assert "u8" in gathered_types, gathers
    # Never a dequantised weight: no floating all-gather of a layer's (out, in).
    for dtype, shape in gathers:
        dims = tuple(int(d) for d in shape.split(",") if d)
        if dtype != "u8":
            assert dims[-2:] not in ((HIDDEN, DIM), (DIM, HIDDEN)), (dtype, dims)


def test_tensor_parallel_same_loss_and_gradients(mesh, one_device):
    model, x, y, loss, grads = one_device
    rules = [("**.up.weight", rows("data")), ("**.down.weight", columns("data"))]
    step, trainable, frozen, data = _sharded_step(model, mesh, rules, P())
    up = frozen.layers.up.weight.w
    assert up.packed.sharding.spec == P(None, "data")  # rows of the stored weight
    assert frozen.layers.down.weight.w.packed.sharding.spec == P(None, None, "data")
    x, y = jax.device_put(x, data), jax.device_put(y, data)
    got_loss, got_grads = step(trainable, frozen, x, y)
    assert tree_allclose(got_loss, loss, rtol=1e-4, atol=1e-5)
    leaves = jax.tree_util.tree_leaves
    assert tree_allclose(leaves(got_grads), leaves(grads), rtol=1e-3, atol=1e-5)


def test_shard_places_by_rules_and_replicates_the_rest(mesh):
    model = _model()
    placed = shard(model, mesh, [("**.up.weight", P(None, "data"))])
    assert placed.layers.up.weight.w.packed.sharding.spec == P(None, "data")
    assert placed.layers.up.weight.b.sharding.spec == P()
    assert placed.layers.down.weight.w.packed.sharding.is_fully_replicated


# --- what `fsdp` splits: the layers of a stack stay whole ---------------------------
#
# 8 layers on 8 devices: the layer axis divides, so only reading the stacking keeps
# a stacked vector `(8, DIM)` from being split along its layers.

STACK = 8


class Block(eqx.Module):
    norm: jax.Array  # a vector per layer: `(STACK, DIM)` once stacked
    gain: jax.Array  # a scalar per layer: `(STACK,)`
    up: eqx.nn.Linear  # weight and bias: a matrix and a vector per layer

    def __init__(self, key):
        self.norm = jnp.ones(DIM)
        self.gain = jnp.ones(())
        self.up = eqx.nn.Linear(DIM, HIDDEN, key=key)


class Stacked(eqx.Module):
    embedding: jax.Array  # `(64, DIM)`: unstacked, beside the stack
    blocks: Block  # stacked
    norm: jax.Array  # `(DIM,)`: unstacked
    head: eqx.nn.Linear  # unstacked

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embedding = jr.normal(k1, (64, DIM))
        self.blocks = eqx.filter_vmap(Block)(jr.split(k2, STACK))
        self.norm = jnp.ones(DIM)
        self.head = eqx.nn.Linear(DIM, STACK, key=k3)  # `(8, DIM)`: 8 rows, not 8 layers


def _specs(model, mesh, **options):
    shardings = model_shardings(model, mesh, [("**", fsdp(mesh, **options))])
    return jax.tree_util.tree_map(lambda s: s.spec, shardings)


def test_fsdp_keeps_stacked_layers_whole_for_vectors_and_matrices(mesh):
    model = eqx.filter_eval_shape(Stacked, jr.key(0))
    specs = _specs(model, mesh)
    # Stacked: the layer axis whole, each layer's vector or matrix split.
    assert specs.blocks.norm == P(None, "data")
    assert specs.blocks.up.bias == P(None, "data")
    assert specs.blocks.up.weight == P(None, "data", None)
    assert specs.blocks.gain == P()  # a scalar per layer: nothing of a layer to split
    # Unstacked: a vector and a matrix split along their first (the rows) axis,
    # also an `(8, DIM)` matrix whose rows number as many as the layers.
    assert specs.norm == P("data")
    assert specs.embedding == P("data", None)
    assert specs.head.weight == P("data", None)
    assert specs.head.bias == P("data")
    assert stack_depths(model) == {
        f"blocks.{name}": 1 for name in ("norm", "gain", "up.weight", "up.bias")
    }
    # Called by hand, the rule sees a shape only: `(8, DIM)` is a matrix.
    assert fsdp(mesh)("blocks.norm", (STACK, DIM)) == [P("data", None), P(None, "data"), P()]


def test_fsdp_stacking_of_values_and_of_a_stack_alone(mesh):
    # A stack of QLoRA layers (the weights `LoraArray`s over NF4) read through the
    # Values' logical shapes; a model holding only the stack and a vector beside it
    # does not make the vector a stack of scalars.
    class Model(eqx.Module):
        blocks: Block
        norm: jax.Array

    def make(key):
        blocks = eqx.filter_vmap(Block)(jr.split(key, STACK))
        return qlora(Model(blocks, jnp.ones(DIM)), bits="nf4", rank=2, key=key)

    model = eqx.filter_eval_shape(make, jr.key(0))
    specs = _specs(model, mesh)
    assert specs.blocks.up.weight == P(None, "data", None)
    assert specs.blocks.norm == P(None, "data")
    assert specs.norm == P("data")


def test_fsdp_stacked_leaves_named_by_hand(mesh):
    # No layer of a known type to read the stacking from: `stacked=` names it.
    class Raw(eqx.Module):
        w: jax.Array
        norm: jax.Array

    raw = {"blocks": Raw(jnp.ones((STACK, HIDDEN, DIM)), jnp.ones((STACK, DIM)))}
    assert _specs(raw, mesh)["blocks"].norm == P("data", None)  # read as a matrix
    specs = _specs(raw, mesh, stacked="blocks.**")
    assert specs["blocks"].norm == P(None, "data")
    assert specs["blocks"].w == P(None, "data", None)
    specs = _specs(raw, mesh, stacked=path("**").within(Raw))
    assert specs["blocks"].norm == P(None, "data")
