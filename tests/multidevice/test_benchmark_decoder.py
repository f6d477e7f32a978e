"""The decoder of `benchmarks/scale.py` sharded FSDP-style over 8 devices, its
residual stream checkpointed every 2 of 5 layers (`layers_per_checkpoint`): the
loss and gradients of one device checkpointing every layer, and each layer's
weights still gathered one layer at a time as packed codes, never dequantised.
Run through `tests/test_multidevice.py`."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.lora import partition, qlora
from quaxlike.sharding import fsdp, model_shardings


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: run through tests/test_multidevice.py"
)

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from _decoder import Decoder, SHAPES
    from _harness import random_b
    from _sharded import (
        AXIS,
        collectives,
        dequantised_gathers,
        fsdp_rules,
        make_mesh,
        sharded_loss,
        weight_shapes,
    )
finally:
    sys.path.remove(BENCHMARKS)

SHAPE = dataclasses.replace(SHAPES["tiny"], layers=5)
CHUNKS = dict(attention_chunk=8, mlp_chunk=16, loss_chunk=8)
BATCH = 8


def _model(**options):
    model = Decoder(SHAPE, jr.key(0), **CHUNKS, **options)
    model = qlora(model, bits="nf4", group_size=64, double_quant=True, rank=4, key=jr.key(1))
    return random_b(model)


def test_fsdp_grouped_checkpoints_same_loss_and_gradients_and_gathers_codes():
    tokens = jr.randint(jr.key(3), (BATCH, SHAPE.seq), 0, SHAPE.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    loss = sharded_loss(lambda m, t, y: m.loss(t, y))
    step = jax.jit(jax.value_and_grad(loss))
    want_loss, want_grads = step(*partition(_model()), tokens, targets)

    mesh = make_mesh(8)
    model = _model(layer_mesh=mesh, layers_per_checkpoint=2)
    placed = quaxlike.device_put(model, model_shardings(model, mesh, fsdp_rules(mesh)))
    trainable, frozen = partition(placed)
    data = NamedSharding(mesh, P(AXIS))
    tokens, targets = jax.device_put(tokens, data), jax.device_put(targets, data)
    got_loss, got_grads = step(trainable, frozen, tokens, targets)
    assert tree_allclose(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    # The models differ in static fields: compare the leaves (bfloat16 factors).
    leaves = jax.tree_util.tree_leaves
    assert tree_allclose(leaves(got_grads), leaves(want_grads), rtol=2e-2, atol=1e-4)

    ops = collectives(step.lower(trainable, frozen, tokens, targets).compile().as_text())
    gathered = [op for op in ops if op.kind == "all-gather"]
    assert any(op.dtype == "u8" for op in gathered), gathered  # the packed codes
    assert not dequantised_gathers(ops, weight_shapes(SHAPE))
    # One layer's codes at a time, `(rows, in)`: never a group's `(k, rows, in)`.
    assert all(len(op.shape) == 2 for op in gathered if op.dtype == "u8"), gathered


def _compiled_memory(model, mesh, rules, tokens):
    """Arguments and temporaries of the compiled training gradient, per device."""
    placed = quaxlike.device_put(model, model_shardings(model, mesh, rules))
    step = jax.jit(jax.value_and_grad(sharded_loss(lambda m, t, y: m.loss(t, y))))
    memory = step.lower(*partition(placed), tokens, tokens).compile().memory_analysis()
    assert memory is not None
    return memory.argument_size_in_bytes, memory.temp_size_in_bytes


def test_fsdp_places_the_stacked_norms_as_they_were_placed_by_hand():
    # `fsdp_rules` used to place the blocks' norm weights, `(layers, dim)`, by hand
    # along their features, since `fsdp` split their layer axis; `fsdp` now keeps
    # it whole itself: the same placement, the same compiled memory.
    mesh = make_mesh(8)
    model = _model(layer_mesh=mesh, layers_per_checkpoint=2)
    by_hand = [
        ("embedding", P(None, AXIS)),
        ("blocks.attention_norm", P(None, AXIS)),
        ("blocks.mlp_norm", P(None, AXIS)),
        ("**", fsdp(mesh, AXIS)),
    ]
    specs = model_shardings(model, mesh, fsdp_rules(mesh))
    assert specs.blocks.attention_norm.spec == P(None, AXIS)
    assert specs.blocks.mlp_norm.spec == P(None, AXIS)
    leaves = jax.tree_util.tree_leaves
    assert leaves(specs) == leaves(model_shardings(model, mesh, by_hand))
    tokens = jax.device_put(jnp.zeros((BATCH, SHAPE.seq), jnp.int32), NamedSharding(mesh, P(AXIS)))
    now = _compiled_memory(model, mesh, fsdp_rules(mesh), tokens)
    before = _compiled_memory(model, mesh, by_hand, tokens)
    assert all(a <= b for a, b in zip(now, before)), (now, before)
