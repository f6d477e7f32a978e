"""What the multi-process test trains, shared by its worker processes and by its
one-process reference: a LoRA (or QLoRA) MLP, a batch, how to place both on a
mesh (fully sharded data parallelism, by the logical API), and a few optax
steps."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.lora import LoraArray, loraify, partition
from quaxlike.quantized import Int4Array, quantize
from quaxlike.sharding import fsdp, model_shardings


IN, WIDTH, OUT, BATCH, RANK, STEPS = 16, 32, 8, 32, 4, 5


def _is_lora(x) -> bool:
    return isinstance(x, LoraArray)


def model(kind: str):
    """An MLP with LoRA weights (`kind="lora"`), or LoRA over 4-bit weights
    (`kind="qlora"`), whose `B` factors are non-zero (as if trained already)."""
    mlp = eqx.nn.MLP(IN, OUT, WIDTH, depth=2, key=jr.key(0))
    if kind == "qlora":
        mlp = quantize(mlp, bits=4, group_size=8)
    lora = loraify(mlp, rank=RANK, key=jr.key(1), scale=0.1)
    weights = [layer.weight for layer in lora.layers]
    if not all(_is_lora(w) for w in weights):
        raise TypeError(f"loraify left weights of types {[type(w).__name__ for w in weights]}")
    if kind == "qlora" and not all(isinstance(w.w, Int4Array) for w in weights):
        raise TypeError(f"QLoRA bases are {[type(w.w).__name__ for w in weights]}, not Int4Array")
    rng = np.random.default_rng(2)

    def nonzero_b(leaf):
        if not _is_lora(leaf):
            return leaf
        b = 0.05 * rng.standard_normal(leaf.b.shape).astype(np.float32)
        return leaf.with_factors(leaf.w, leaf.a, jax.device_put(b))

    return jax.tree.map(nonzero_b, lora, is_leaf=_is_lora)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((BATCH, IN)).astype(np.float32)
    return xs, np.tanh(xs[:, :OUT])


def _global(x, sharding: NamedSharding) -> jax.Array:
    # Every process holds the whole host value and gives each of its devices its
    # block: a global array over the devices of all processes.
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place(model, xs, ys, mesh):
    """Fully sharded data parallelism over every device of the mesh, with the
    logical API: each weight (a Value as one: a LoRA's `W`, or its 4-bit codes
    and scales, and `A`) split by its logical rows over ("data", "model"), as
    `quaxlike.sharding.fsdp` chooses, each Value's leaves following its
    type's declaration; the batch split over the same devices."""
    everywhere = ("data", "model")
    arrays, static = eqx.partition(model, eqx.is_array)
    logical = model_shardings(arrays, mesh, [("**", fsdp(mesh, everywhere))])
    shardings = quaxlike.leaf_shardings(arrays, logical)
    arrays = jax.tree.map(_global, arrays, shardings)
    batch = NamedSharding(mesh, P(everywhere))
    return eqx.combine(arrays, static), _global(xs, batch), _global(ys, batch)


def train(model, xs, ys, steps: int = STEPS):
    """Adam on the LoRA factors; the trained factors and the loss at each step."""
    trainable, frozen = partition(model)
    optimiser = optax.adam(1e-2)

    # `frozen` is an argument, not closed over: split across processes, no process
    # holds all of it.
    @eqx.filter_jit
    def step(trainable, opt_state, frozen, xs, ys):
        def loss_fn(trainable):
            m = eqx.combine(trainable, frozen)
            return jnp.mean((jax.vmap(quaxlike.quaxify(m))(xs) - ys) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    opt_state, losses = optimiser.init(trainable), []
    for _ in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state, frozen, xs, ys)
        losses.append(float(loss))  # a replicated scalar: every process has it
    return trainable, losses
