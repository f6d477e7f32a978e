"""Compiled step time of DoRA against LoRA (and QDoRA against QLoRA NF4), run
interleaved on the default device.

The steps are `scale.py`'s (a Llama-shaped decoder, `--models small` by default:
d=512, 4 layers, seq 256; rank 16 on every Linear; optax.adam), compiled once
each for their abstract arguments, then run on random arrays of those shapes,
round after round in turn (so that a busy machine slows every row alike): the
median seconds per step and the ratios DoRA / LoRA and QDoRA / QLoRA NF4.
PEFT's documentation measures DoRA at 2.39 times LoRA's time (Llama-3.1-8B).

    python benchmarks/dora_step.py [--rounds 7] [--model small|tiny|1b|8b]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import scale
from _decoder import SHAPES
from _execute import random_like

from quaxlike.lora import DoraArray


PAIRS = ((scale.DORA, scale.LORA), (scale.QDORA, scale.NF4))


def positive_norms(tree):
    """Random arguments with every DoRA magnitude and `‖W‖²` positive (a random
    normal draw would give infinite row scales and NaNs)."""

    def fix(x):
        if not isinstance(x, DoraArray):
            return x
        fields = {}
        for field in ("m", "w_norm_sq"):
            value = getattr(x, field)
            if value is not None:
                fields[field] = jnp.abs(value) + 1
        return x._replaced(**fields)

    return jax.tree_util.tree_map(fix, tree, is_leaf=lambda x: isinstance(x, DoraArray))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds after a warm-up")
    parser.add_argument("--model", default="small", choices=("small", "tiny", "1b", "8b"))
    args = parser.parse_args(argv)
    shape = scale.SMALL if args.model == "small" else SHAPES[args.model]
    optimiser = optax.adam(1e-4)
    memory = scale.memory_options(shape)
    names = [name for pair in PAIRS for name in pair]
    steps, states = {}, {}
    tokens = jr.randint(jr.key(8), (1, shape.seq), 0, shape.vocab, jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    for name in names:
        trace, state = scale.tracer(shape, name, optimiser, memory)
        steps[name] = trace().lower().compile()
        states[name] = positive_norms(random_like(state, jr.key(7)))
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):
        for name in names:
            trainable, opt_state, frozen = states[name]
            start = time.perf_counter()
            trainable, opt_state, loss = steps[name](trainable, opt_state, frozen, tokens, targets)
            jax.block_until_ready((trainable, opt_state, loss))
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - start)
            states[name] = (trainable, opt_state, frozen)
    print(
        f"{shape.name} decoder (d={shape.dim}, {shape.layers} layers, seq {shape.seq}), "
        f"{jax.devices()[0].platform}, {args.rounds} interleaved rounds"
    )
    print("| step | median | min | max |")
    print("|---|---|---|---|")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(
            f"| {name} | {median[name] * 1e3:.1f} ms | {min(t) * 1e3:.1f} ms | "
            f"{max(t) * 1e3:.1f} ms |"
        )
    for dora, lora in PAIRS:
        print(f"{dora} / {lora}: {median[dora] / median[lora]:.2f}")


if __name__ == "__main__":
    main()
