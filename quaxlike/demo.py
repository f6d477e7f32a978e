"""`python -m quaxlike.demo`: fine-tune a small Equinox MLP with LoRA weights.

The task: fit a random "teacher" MLP that differs from the pretrained "student"
by a low-rank change of its weights. Only the LoRA factors are trained.
"""

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.random as jr
import optax

import quaxlike
from quaxlike.examples.lora import LoraArray, loraify, trainable_filter


def _count(tree) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array)))


def _dense_lora_products(jaxpr, lora_shapes, rank: int) -> int:
    """How many equations of the program build an array of a LoRA weight's shape
    by contracting over a dimension of size `rank` (that is, `A @ B`)."""
    count = 0
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _dense_lora_products(sub, lora_shapes, rank)
        if eqn.primitive.name == "dot_general":
            out_shape = tuple(eqn.outvars[0].aval.shape)
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            sizes = [lhs_shape[d] for d in contract]
            if out_shape in lora_shapes and sizes == [rank]:
                count += 1
    return count


def main(steps: int = 150, rank: int = 4, width: int = 64) -> None:
    key_student, key_teacher, key_lora, key_data = jr.split(jr.key(0), 4)
    student = eqx.nn.MLP(16, 4, width, depth=3, key=key_student)
    # The teacher is the student plus a rank-2 change of every weight matrix.
    teacher = loraify(student, rank=2, scale=0.3, key=key_teacher)
    teacher = jax.tree_util.tree_map(
        lambda x: (
            x.with_factors(x.w, x.a, 0.3 * jr.normal(key_teacher, x.b.shape))
            if isinstance(x, LoraArray)
            else x
        ),
        teacher,
        is_leaf=lambda x: isinstance(x, LoraArray),
    )
    teacher = quaxlike.quaxify(teacher)
    xs = jr.normal(key_data, (256, 16))
    ys = jax.vmap(teacher)(xs)

    model = loraify(student, rank=rank, key=key_lora)
    trainable, frozen = eqx.partition(model, trainable_filter(model))
    optimiser = optax.adam(3e-3)
    opt_state = optimiser.init(trainable)

    @eqx.filter_jit
    def step(trainable, opt_state):
        def loss_fn(trainable):
            model = eqx.combine(trainable, frozen)
            predictions = jax.vmap(quaxlike.quaxify(model))(xs)
            return jnp.mean((predictions - ys) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    print(f"LoRA fine-tuning of an MLP 16 -> {width} x 3 -> 4 with rank {rank}")
    losses = []
    for i in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state)
        losses.append(float(loss))
        if i % 25 == 0 or i == steps - 1:
            print(f"  step {i:4d}  loss {float(loss):.5f}")

    n_trainable = _count(trainable)
    n_full = _count(student)
    print(f"trainable parameters: {n_trainable} of {n_full} ({100 * n_trainable / n_full:.1f}%)")

    # No dense W + AB: LoraArray refuses to materialise (allow_materialise=False),
    # and the traced training step contains no product of the two factors.
    model = eqx.combine(trainable, frozen)
    loras = [
        x
        for x in jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, LoraArray))
        if isinstance(x, LoraArray)
    ]
    shapes = {tuple(x.w.shape) for x in loras}
    jaxpr = jax.make_jaxpr(
        lambda t: jax.grad(
            lambda t: jnp.sum(jax.vmap(quaxlike.quaxify(eqx.combine(t, frozen)))(xs))
        )(t)
    )(trainable)
    products = _dense_lora_products(jaxpr.jaxpr, shapes, rank)
    print(f"dense W + AB products in the traced training step: {products}")
    assert products == 0
    assert losses[-1] < 0.5 * losses[0], "the loss should go down"
    print(f"loss went from {losses[0]:.5f} to {losses[-1]:.5f}; no LoRA weight was materialised.")


if __name__ == "__main__":
    main()
