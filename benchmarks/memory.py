"""Memory of one training step: LoRA (quaxlike) against the same LoRA step written
by hand in JAX, and against full fine-tuning of the dense model.

Each step is `jax.jit`-compiled: a mean-squared-error loss over a batch
(`jax.vmap`), `jax.value_and_grad` with respect to the trainable parameters, and
an `optax.adam` update of those parameters.

- quaxlike LoRA: `loraify(model, rank=8)`; trainable = the `A`, `B` factors
  (`quaxlike.lora.partition`), `W` and the biases frozen;
- hand-written LoRA: the same maths in plain JAX
  (`stop_gradient(W) @ x + A @ (B @ x) + bias`), trainable `A`, `B`;
- full fine-tune: the dense model, every weight and bias trainable.

Sizes come from XLA (`compiled.memory_analysis()`): arguments, outputs, temporary
buffers and aliasing (none: nothing is donated). "peak" is arguments + outputs +
temporaries - aliased: what the step needs at its peak, inputs included (the
weights, however they are stored). A figure of the weights alone would hide the
temporaries. They are exact, so nothing is repeated. (`qlora.py` measures the
same for QLoRA, and `quantized.py` for quantised models.)

Run: `python benchmarks/memory.py [--quick]`.
"""

import _harness as h
import jax
import jax.random as jr
import numpy as np
import optax

from quaxlike.lora import loraify, partition


RANK = 8


def make_steps(depth, width):
    optimiser = optax.adam(1e-3)
    dense = h.make_stack(depth, width)
    lora = h.random_b(loraify(dense, rank=RANK, key=jr.key(1), scale=0.1))

    # quaxlike LoRA
    trainable, frozen = partition(lora)

    # the same, by hand
    layers = h.lora_layers(lora)
    hand_trainable = [(a, b) for _, a, b, _ in layers]
    hand_frozen = [(w, bias) for w, _, _, bias in layers]

    def hand_loss(trainable, frozen, xs, ys):
        params = [(w, a, b, bias) for (a, b), (w, bias) in zip(trainable, frozen)]
        return h.mse(jax.vmap(lambda x: h.hand_lora_stack(params, x))(xs), ys)

    return {
        "quaxlike LoRA": (
            h.training_step(optimiser, h.quaxlike_loss),
            (trainable, optimiser.init(trainable), frozen),
        ),
        "hand-written LoRA": (
            h.training_step(optimiser, hand_loss),
            (hand_trainable, optimiser.init(hand_trainable), hand_frozen),
        ),
        # full fine-tuning of the dense model
        "full fine-tune (dense)": (
            h.training_step(optimiser, h.dense_loss),
            (dense, optimiser.init(dense)),
        ),
    }


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=0)  # nothing timed
    depth, width, batch = (1, 8, 2) if args.quick else (32, 256, 64)
    xs = h.array((batch, width), seed=2)
    ys = h.array((batch, width), seed=3)
    steps = make_steps(depth, width)

    results = {}
    for name, (step, state) in steps.items():
        compiled = jax.jit(step).lower(*state, xs, ys).compile()
        out = compiled(*state, xs, ys)
        results[name] = (compiled.memory_analysis(), h.n_params(state[0]), out)

    same = bool(
        np.allclose(results["quaxlike LoRA"][2][2], results["hand-written LoRA"][2][2], rtol=1e-5)
        and all(
            np.allclose(q, p, rtol=1e-4, atol=1e-6)
            for q, p in zip(
                jax.tree_util.tree_leaves(results["quaxlike LoRA"][2][0]),
                jax.tree_util.tree_leaves(results["hand-written LoRA"][2][0]),
            )
        )
    )
    h.print_header(
        "memory: one jit-compiled training step (value_and_grad + adam), from memory_analysis()",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu, depth {depth}, batch {batch}, "
            f"LoRA rank {RANK}, float32",
            f"quaxlike and hand-written LoRA steps give the same loss and updated factors: {same}",
        ],
    )
    table = h.Table(
        "Training-step memory",
        [
            "step",
            "trainable params",
            "arguments",
            "outputs",
            "temp",
            "alias",
            "peak",
            "vs hand-written LoRA",
            "vs full fine-tune",
        ],
    )

    def peak(stats):
        return (
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes
        )

    hand_peak = peak(results["hand-written LoRA"][0])
    full_peak = peak(results["full fine-tune (dense)"][0])
    for name, (stats, params, _) in results.items():
        table.add(
            name,
            f"{params:,}",
            h.fmt_bytes(stats.argument_size_in_bytes),
            h.fmt_bytes(stats.output_size_in_bytes),
            h.fmt_bytes(stats.temp_size_in_bytes),
            h.fmt_bytes(stats.alias_size_in_bytes),
            h.fmt_bytes(peak(stats)),
            f"{peak(stats) / hand_peak:.2f}",
            f"{peak(stats) / full_peak:.2f}",
        )
    table.print(
        [
            "Target: quaxlike LoRA = hand-written LoRA (1.00), both well below full fine-tuning "
            "(no gradients or optimiser state for W)."
        ]
    )


if __name__ == "__main__":
    main()
