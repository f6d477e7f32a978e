"""The memory of one full fine-tuning step of a Llama-shaped decoder trained in
float8 (`float8_training`, tensorwise and rowwise) beside the same step in
bfloat16, compiled for shapes only.

The model, loss, chunking and step are benchmarks/scale.py's (its docstring
says how): every leaf trainable, one `optax.adam` step, the arguments abstract
(`eqx.filter_eval_shape`), the compiled step's `memory_analysis()`. The float8
rows make every `eqx.nn.Linear` weight of the decoder blocks a `Float8Weight`
(the output head stays bfloat16, as torchtitan's float8 leaves `output` out),
so that each projection's three matrix products (output, gradient of the
input, gradient of the weight) are float8 `dot_general`s; the count of float8
dots in the lowered step is printed beside each row (each block's 7
projections, forward, recomputed under `jax.checkpoint`, and backward, in the
scanned block's body).

What it answers: whether float8 training costs memory over bfloat16. torchao
keeps the high-precision input and weight for the backward pass and casts them
again (so does `Float8Weight`): the float8 casts are temporaries of each
product, and the saved activations are those of the bfloat16 step.

`--quick` compiles the small model (4 layers, d=512) and first checks, on the
tiny one, that the float8 step runs on CPU and gives a loss within 5% of the
bfloat16 step's. `--models 8b 1b` (the default) compiles those.

Run: `python benchmarks/float8_step.py [--quick] [--models 8b 1b small]`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import _harness as h
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import optax
import scale
from _decoder import Decoder, SHAPES

from quaxlike.quantized import float8_training
from quaxlike.selection import module, path


BF16 = "bf16 full fine-tuning"
TENSORWISE = "float8 tensorwise"
ROWWISE = "float8 rowwise"
GIB = 2**30


def _float8(scaling: str):
    where = module(eqx.nn.Linear).within(path("blocks"))

    def build(model, key):
        return scale._full(float8_training(model, scaling=scaling, where=where), key)

    return build


# scale.measure looks its rows up in scale.VARIANTS: add the float8 ones.
scale.VARIANTS.update(
    {
        BF16: (scale._full, scale._plain_loss),
        TENSORWISE: (_float8("tensorwise"), scale._quaxlike_loss),
        ROWWISE: (_float8("rowwise"), scale._quaxlike_loss),
    }
)
ROWS = (BF16, TENSORWISE, ROWWISE)


def float8_dots(shape, name: str, optimiser, memory) -> int:
    """How many `dot_general`s of the lowered step take float8 operands."""
    trace, _ = scale.tracer(shape, name, optimiser, memory)
    text = trace().lower().as_text()
    dots = re.findall(r"stablehlo\.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    return sum("f8E" in a and "f8E" in b for a, b in dots)


def check_tiny(optimiser) -> None:
    """The tiny model's float8 steps run on CPU, with a loss near bfloat16's."""
    shape = SHAPES["tiny"]
    memory = scale.memory_options(shape)
    tokens = jr.randint(jr.key(3), (1, shape.seq), 0, shape.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    losses = {}
    for name in ROWS:
        build, loss = scale.VARIANTS[name]
        trainable, frozen = build(Decoder(shape, jr.key(0), **memory), jr.key(1))
        step = eqx.filter_jit(h.training_step(optimiser, loss))
        _, _, value = step(trainable, optimiser.init(trainable), frozen, tokens, targets)
        losses[name] = float(value)
    print("tiny model, loss of one step:", {k: round(v, 4) for k, v in losses.items()})
    for name in (TENSORWISE, ROWWISE):
        gap = abs(losses[name] - losses[BF16]) / losses[BF16]
        assert gap < 0.05, (name, losses)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only")
    parser.add_argument("--models", nargs="+", choices=("8b", "1b", "small"), default=("8b", "1b"))
    args = parser.parse_args(argv)
    optimiser = optax.adam(1e-4)
    check_tiny(optimiser)
    models = ("small",) if args.quick else args.models
    for key in models:
        shape = scale.SMALL if key == "small" else SHAPES[key]
        memory = scale.memory_options(shape)
        print(f"\n{shape.name}: {scale._memory_title(memory)}")
        print("| step | peak GiB | arguments GiB | temporaries GiB | float8 dots | compile s |")
        print("| --- | --- | --- | --- | --- | --- |")
        peaks = {}
        for name in ROWS:
            start = time.perf_counter()
            result = scale.measure(shape, name, optimiser, memory=memory)
            seconds = time.perf_counter() - start
            dots = float8_dots(shape, name, optimiser, memory)
            peaks[name] = result.peak
            print(
                f"| {name} | {result.peak / GIB:.2f} | {result.arguments / GIB:.2f} | "
                f"{result.temporaries / GIB:.2f} | {dots} | {seconds:.0f} |",
                flush=True,
            )
        for name in (TENSORWISE, ROWWISE):
            print(f"{name}: peak {peaks[name] / peaks[BF16]:.3f} x bfloat16's")


if __name__ == "__main__":
    main(sys.argv[1:])
