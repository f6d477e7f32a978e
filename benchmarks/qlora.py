"""One QLoRA training step: peak memory against LoRA on the dense model and full
fine-tuning, and run time against the same step written by hand in JAX.

The model is a stack of `depth` `eqx.nn.Linear(width, width)` + relu layers (8 of
width 1024: 32 MiB of float32 weights, so that weights dominate), a batch of 8,
LoRA rank 8. Each step is `jax.jit`-compiled: a mean-squared-error loss over the
batch (`jax.vmap`), `jax.value_and_grad` with respect to the trainable
parameters, and an `optax.adam` update of them.

- quaxlike QLoRA: `qlora(model, bits=4 | 8, rank=8)`: every weight a `LoraArray`
  over an `Int4Array` (or `Int8Array`); trainable: the factors (`partition`);
- quaxlike LoRA on the dense model: `loraify(model, rank=8)`;
- hand-written int4 + LoRA: the same leaves in plain JAX,
  `stop_gradient(W) @ x + A @ (B @ x) + bias` with `W @ x` computed on the 4-bit
  codes either block by block as quaxlike does ("blocked", `_plain_quantized.py`)
  or by dequantising `W` whole first ("naive");
- full fine-tuning of the dense model: every weight and bias trainable.

Peak is `memory_analysis()`'s arguments + outputs + temporaries - aliased bytes
(exact). Time is the median of interleaved runs against the hand-written
blocked int4 step, with the paired ratios' spread.

Run: `python benchmarks/qlora.py [--quick] [--repeats N]`.
"""

import functools as ft

import _harness as h
import _plain_quantized as plain
import jax
import jax.random as jr
import numpy as np
import optax

from quaxlike.lora import LoraArray, loraify, partition, qlora
from quaxlike.quantized._matmul import block_rows


RANK = 8
PEAK_TARGET = 0.35  # QLoRA int4 against LoRA on the dense model
TIME_TARGET = 1.10  # QLoRA int4 against the hand-written blocked int4 + LoRA step
BASELINE = "hand-written int4 + LoRA, blocked"


def lora_factors(model):
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_lora) if is_lora(x)]


def hand_forward(product, params, x):
    """`relu(stop_gradient(W) x + A (B x) + bias)` per layer, for one input `x`
    (under `jax.vmap`), with `W x` computed by `product(leaves, xs)` on a batch."""
    for leaves, a, b, bias in params:
        base = product(jax.lax.stop_gradient(leaves), x[None])[0]
        x = jax.nn.relu(base + a @ (b @ x) + bias)
    return x


def make_steps(depth, width):
    optimiser = optax.adam(1e-3)
    dense = h.make_stack(depth, width)
    key = jr.key(1)
    models = {
        "quaxlike QLoRA int4": h.random_b(qlora(dense, bits=4, rank=RANK, key=key, scale=0.1)),
        "quaxlike QLoRA int8": h.random_b(qlora(dense, bits=8, rank=RANK, key=key, scale=0.1)),
        "quaxlike LoRA (dense model)": h.random_b(loraify(dense, rank=RANK, key=key, scale=0.1)),
    }

    steps = {}
    for name, model in models.items():
        trainable, frozen = partition(model)
        steps[name] = (
            h.training_step(optimiser, h.quaxlike_loss),
            (trainable, optimiser.init(trainable), frozen),
        )

    # The int4 QLoRA step by hand, on the same leaves.
    q4 = models["quaxlike QLoRA int4"]
    loras = lora_factors(q4)
    rows = block_rows(loras[0].w)[1]
    hand_trainable = [(x.a, x.b) for x in loras]
    hand_frozen = [(plain.leaves_of(x.w), layer.bias) for x, layer in zip(loras, q4.layers)]

    def hand_loss(product, trainable, frozen, xs, ys):
        params = [(w, a, b, bias) for (a, b), (w, bias) in zip(trainable, frozen)]
        return h.mse(jax.vmap(lambda x: hand_forward(product, params, x))(xs), ys)

    def hand_step(product):
        return h.training_step(optimiser, ft.partial(hand_loss, product))

    hand_state = (hand_trainable, optimiser.init(hand_trainable), hand_frozen)
    steps[BASELINE] = (
        hand_step(ft.partial(plain.blocked, "int4", rows=rows)),
        hand_state,
    )
    steps["hand-written int4 + LoRA, naive"] = (
        hand_step(ft.partial(plain.naive, "int4")),
        hand_state,
    )

    steps["full fine-tune (dense)"] = (
        h.training_step(optimiser, h.dense_loss),
        (dense, optimiser.init(dense)),
    )
    return steps


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=15)
    depth, width, batch = (2, 64, 2) if args.quick else (8, 1024, 8)
    calls = 1 if args.quick else 3
    xs = h.array((batch, width), seed=2)
    ys = h.array((batch, width), seed=3)
    steps = make_steps(depth, width)
    if args.quick:  # the smoke test: fewer programs to compile
        for name in ("quaxlike QLoRA int8", "hand-written int4 + LoRA, naive"):
            del steps[name]

    results = {}
    for name, (step, state) in steps.items():
        compiled = jax.jit(step).lower(*state, xs, ys).compile()
        results[name] = (compiled, state, h.peak_bytes(compiled))

    # Adam's first update is about `lr * sign(grad)`, so factors whose gradient is
    # near zero may differ by up to a step: compared to within 5% of one (5e-5).
    # The check asks whether the two steps compute the same mathematics, so both
    # run with float32 matrix products (a GPU's default precision for float32
    # products is lower, and the two programs round differently).
    with jax.default_matmul_precision("float32"):
        quax, hand = (
            jax.jit(steps[name][0])(*steps[name][1], xs, ys)
            for name in ("quaxlike QLoRA int4", BASELINE)
        )
    same = bool(
        np.allclose(quax[2], hand[2], rtol=1e-5)
        and all(
            np.allclose(q, p, rtol=1e-4, atol=5e-5)
            for q, p in zip(jax.tree_util.tree_leaves(quax[0]), jax.tree_util.tree_leaves(hand[0]))
        )
    )
    h.print_header(
        "qlora: one jit-compiled QLoRA training step (value_and_grad + adam)",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu, depth {depth}, batch {batch}, "
            f"LoRA rank {RANK}, int4 group size 32, float32; {calls} calls per timed sample",
            "peak = arguments + outputs + temporaries - aliased (memory_analysis())",
            f"quaxlike QLoRA int4 and the hand-written blocked step give the same loss and "
            f"updated factors (to 5% of an Adam step): {same}",
        ],
    )
    baseline = results[BASELINE]
    lora_peak = results["quaxlike LoRA (dense model)"][2]
    full_peak = results["full fine-tune (dense)"][2]
    table = h.Table(
        "QLoRA training step",
        [
            "step",
            "trainable params",
            "peak",
            "peak / LoRA (dense)",
            "peak / full fine-tune",
            "time",
            f"time / {BASELINE}",
            "paired IQR",
            "target",
        ],
    )
    for name, (compiled, state, peak) in results.items():
        for _ in range(2):
            jax.block_until_ready((baseline[0](*baseline[1], xs, ys), compiled(*state, xs, ys)))
        paired = h.interleaved(
            lambda: h.per_call(lambda: baseline[0](*baseline[1], xs, ys), calls),
            lambda compiled=compiled, state=state: h.per_call(
                lambda: compiled(*state, xs, ys), calls
            ),
            args.repeats,
        )
        target = "-"
        if name == "quaxlike QLoRA int4":
            target = (
                f"peak {h.at_most(peak / lora_peak, PEAK_TARGET)}, "
                f"time {h.at_most(paired.ratio, TIME_TARGET)}"
            )
        table.add(
            name,
            f"{h.n_params(state[0]):,}",
            h.fmt_bytes(peak),
            f"{peak / lora_peak:.3f}",
            f"{peak / full_peak:.3f}",
            h.fmt_time(paired.quax_median / calls),
            f"{paired.ratio:.2f}",
            paired.spread(),
            target,
        )
    table.print()


if __name__ == "__main__":
    main()
