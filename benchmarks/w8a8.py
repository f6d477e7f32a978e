"""Int8 dynamic activations (W8A8) against int8 weights alone: the held-out loss
of a small trained language model, and the peak memory of a forward pass.

Loss: the demo's character transformer (as in benchmarks/calibration.py: width
128, 2 blocks, trained in float32 for `--steps` steps of adam), every
`eqx.nn.Linear` weight quantised with `quantize(model, bits=8)` (an `Int8Array`:
absmax / 127 per output channel, products in float32) or `quantize(model,
bits=8, activations=8)` (a `W8A8Array`: torchao's weights, and each product's
input quantised to int8 per token, int8 x int8 -> int32). Mean cross-entropy on
held-out text, and the mean KL divergence from the float model's
next-character distribution.

Memory: a stack of 8 `Linear(1024, 1024)` + relu (benchmarks/quantized.py's
model) applied to `--tokens` tokens, compiled for shapes only on XLA:CPU; peak
bytes (arguments + outputs + temporaries) as a fraction of the float32 model's.

Run: `python benchmarks/w8a8.py [--steps 300] [--tokens 8 256] [--quick]`.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from _language_model import divergence, LENGTH, log_probabilities, mean_loss

import quaxlike
from quaxlike.demo import batches, build, full, peak_bytes, sentences, train
from quaxlike.quantized import quantize


def losses(steps: int) -> None:
    text = sentences("animals", 600, 1) + sentences("machines", 600, 2)
    model, _, _ = train(build(seed=0), full, text, steps, 1e-2, 0)
    held_out_text = sentences("animals", 100, 3) + sentences("machines", 100, 4)
    held_out = jnp.concatenate([b for b, _ in zip(batches(held_out_text, LENGTH, 64, 5), range(4))])
    reference = log_probabilities(model, held_out)
    float_loss = mean_loss(reference, held_out)
    print(f"character transformer (width 128, 2 blocks), {steps} training steps")
    print("| weights | held-out loss | gap to float32 | KL from float32 |")
    print("|---|---|---|---|")
    print(f"| float32 | {float_loss:.4f} | | |")
    for name, options in [
        ("int8 weights (`Int8Array`)", {}),
        ("W8A8 (`W8A8Array`)", {"activations": 8}),
    ]:
        q = quantize(model, bits=8, **options)
        log_p = log_probabilities(q, held_out)
        loss = mean_loss(log_p, held_out)
        kl = divergence(reference, log_p)
        print(f"| {name} | {loss:.4f} | {loss - float_loss:+.5f} | {kl:.6f} |")


class Stack(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def memory(tokens: list[int]) -> None:
    shapes = eqx.filter_eval_shape(
        lambda: Stack([eqx.nn.Linear(1024, 1024, key=jr.key(i)) for i in range(8)])
    )
    models = {
        "float32": shapes,
        "int8 weights": eqx.filter_eval_shape(lambda m: quantize(m, bits=8), shapes),
        "W8A8": eqx.filter_eval_shape(lambda m: quantize(m, bits=8, activations=8), shapes),
    }
    print("| tokens | float32 (MiB) | int8 weights | W8A8 |")
    print("|---|---|---|---|")
    for n in tokens:
        x = jax.ShapeDtypeStruct((n, 1024), jnp.float32)
        peaks = {}
        for name, model in models.items():
            forward = jax.jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))
            peaks[name] = peak_bytes(forward.lower(model, x).compile())
        base = peaks["float32"]
        print(
            f"| {n} | {base / 2**20:.2f} | {peaks['int8 weights'] / base:.3f} "
            f"| {peaks['W8A8'] / base:.3f} |"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--quick", action="store_true", help="a smoke test: 20 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.tokens = 20, [8]
    start = time.perf_counter()
    memory(args.tokens)
    losses(args.steps)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
