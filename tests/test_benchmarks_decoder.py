"""The decoder of `benchmarks/scale.py` (`benchmarks/_decoder.py`): checkpointing
the residual stream every k layers (`layers_per_checkpoint`, a scan over
checkpointed groups of checkpointed layers) gives the loss and gradients of
checkpointing every layer, for QLoRA through `quaxify` (the Values' leaves split
by group) and for the same LoRA written in plain JAX."""

import dataclasses
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import tree_allclose

from quaxlike.lora import loraify, partition, qlora


# The benchmark model is user code, written with JAX's default promotion.
pytestmark = pytest.mark.loose_promotion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
try:
    from _decoder import Decoder, hand_lora, hand_trainable, SHAPES
    from _harness import random_b
finally:
    sys.path.remove(os.path.join(ROOT, "benchmarks"))

SHAPE = dataclasses.replace(SHAPES["tiny"], layers=5)
CHUNKS = dict(attention_chunk=8, mlp_chunk=16, loss_chunk=8)


def _qlora(model):
    model = qlora(model, bits="nf4", group_size=64, double_quant=True, rank=4, key=jr.key(1))
    return partition(random_b(model))


def _hand(model):
    return hand_trainable(hand_lora(random_b(loraify(model, rank=4, key=jr.key(1)))))


def _loss(quaxified: bool):
    def loss(trainable, frozen, tokens, targets):
        model = eqx.combine(trainable, frozen)
        per_sequence = lambda m, t, y: m.loss(t, y)  # noqa: E731
        if quaxified:
            import quaxlike

            per_sequence = quaxlike.quaxify(per_sequence)
        return jnp.mean(jax.vmap(per_sequence, (None, 0, 0))(model, tokens, targets))

    return loss


# Groups of 2 (two groups and a layer left over) through `quaxify`; groups of 2
# and of 5 (one group, nothing left over) in plain JAX, which compiles faster.
# Slow tests: each compiles the decoder's step three times (a minute or more on
# two cores); the residuals test below runs by default.
@pytest.mark.slow
@pytest.mark.parametrize(
    "build, quaxified, groups", [(_qlora, True, (2,)), (_hand, False, (2, 5))], ids=["nf4", "hand"]
)
def test_grouped_checkpoints_same_loss_and_gradients(build, quaxified, groups):
    tokens = jr.randint(jr.key(3), (2, SHAPE.seq), 0, SHAPE.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    step = eqx.filter_jit(jax.value_and_grad(_loss(quaxified)))
    results = {}
    for k in (1, *groups):
        model = Decoder(SHAPE, jr.key(0), layers_per_checkpoint=k, **CHUNKS)
        results[k] = step(*build(model), tokens, targets)
    loss, grads = results[1]
    leaves = [x for x in jax.tree_util.tree_leaves(grads) if eqx.is_array(x)]
    assert leaves and all(bool(jnp.any(x != 0)) for x in leaves)  # both factors reached
    for k in groups:
        got_loss, got_grads = results[k]
        assert tree_allclose(got_loss, loss, rtol=1e-6, atol=1e-6), k
        # (The models differ in a static field: compare their leaves.)
        got = jax.tree_util.tree_leaves(got_grads)
        assert tree_allclose(got, jax.tree_util.tree_leaves(grads), rtol=1e-5, atol=1e-6), k


def test_grouped_checkpoints_save_fewer_residuals():
    """The backward pass of checkpoints every 4 of 16 layers keeps 4 group inputs
    and a group's 4 layer inputs at once, not 16: the step's temporaries
    shrink. By how much is XLA's schedule: 8 residuals or more on jax 0.10.2's
    XLA:CPU (which widens them to float32), 4.7 bfloat16 residuals on 0.12's;
    at least 4 on every release tested."""
    shape = dataclasses.replace(SHAPES["tiny"], layers=16, dim=256, seq=256, vocab=64)

    def temporaries(k):
        def state(key):
            return _hand(Decoder(shape, key, layers_per_checkpoint=k, **CHUNKS))

        trainable, frozen = eqx.filter_eval_shape(state, jr.key(0))
        tokens = jax.ShapeDtypeStruct((1, shape.seq), jnp.int32)
        step = jax.jit(jax.grad(_loss(False)))
        compiled = step.trace(trainable, frozen, tokens, tokens).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    residual = shape.seq * shape.dim * 2  # one layer's input, bfloat16
    assert temporaries(1) - temporaries(4) >= 4 * residual
