"""`scale.py --execute`: a compiled step run on random arrays of its abstract
arguments' shapes, for its time per step and the device allocator's peak."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import jax.random as jr
from _decoder import Shape


def random_like(tree, key):
    """`tree` with every `jax.ShapeDtypeStruct` replaced by an array of its shape and
    dtype on the default device, each drawn without a wider temporary: floats
    normal with scale 0.02, in their own dtype; integers from random bits of their
    own width (codes of every value; optimiser step counts too, which only scale
    the update). Other leaves are kept.

    **Arguments:**
    - `tree`: a pytree of `jax.ShapeDtypeStruct`s (from `eqx.filter_eval_shape`).
    - `key`: a PRNG key.

    **Returns:** the same structure, holding arrays.
    """

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(key, shape, dtype):
        if jnp.issubdtype(dtype, jnp.floating):
            return (0.02 * jr.normal(key, shape, dtype)).astype(dtype)
        width = jnp.dtype(dtype).itemsize * 8
        bits = jr.bits(key, shape, dtype=jnp.dtype(f"uint{width}"))
        return jax.lax.bitcast_convert_type(bits, dtype)

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    filled = [
        draw(jr.fold_in(key, i), tuple(leaf.shape), leaf.dtype)
        if isinstance(leaf, jax.ShapeDtypeStruct)
        else leaf
        for i, leaf in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, filled)


def execute(compiled, state, shape: Shape, repeats: int = 3) -> tuple[float, int | None]:
    """Runs the compiled step on random arrays of `state`'s shapes: one warm-up
    step, then `repeats` timed steps, each fed the previous one's donated outputs.

    **Arguments:**
    - `compiled`: the compiled step, `(trainable, opt_state, frozen, tokens,
      targets) -> (trainable, opt_state, loss)`.
    - `state`: `(trainable, opt_state, frozen)` as `jax.ShapeDtypeStruct`s.
    - `shape`: the model's shape (vocabulary and sequence length of the tokens).
    - `repeats`: timed steps.

    **Returns:** `(median seconds per step, peak bytes)`: the device allocator's
    peak bytes in use over the whole process (`memory_stats()`, `None` where the
    backend keeps none), which counts the random arguments and the step.
    """
    trainable, opt_state, frozen = random_like(state, jr.key(7))
    tokens = jr.randint(jr.key(8), (1, shape.seq), 0, shape.vocab, jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    trainable, opt_state, loss = compiled(trainable, opt_state, frozen, tokens, targets)
    jax.block_until_ready(loss)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainable, opt_state, loss = compiled(trainable, opt_state, frozen, tokens, targets)
        jax.block_until_ready((trainable, opt_state, loss))
        times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    return sorted(times)[len(times) // 2], stats.get("peak_bytes_in_use")
