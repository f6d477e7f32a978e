"""Calibrated post-training quantisation: the held-out loss of a small trained
language model after round-to-nearest, GPTQ and AWQ, against the unquantised
model.

The model is the demo's character-level transformer (`quaxlike.demo`: width
128, 2 blocks of attention and an MLP, 4 heads), trained in float32 with adam on
the demo's text about animals and machines for `--steps` steps. Every
`eqx.nn.Linear` weight (the attention projections, the MLPs, the output head:
13 weights) is then quantised with `quantize(model, bits=..., group_size=...,
method=...)`, GPTQ and AWQ calibrated on `--calibration` batches of 16 windows
of 32 characters of the training text (run as `jax.vmap(model)(batch)`), and
the mean cross-entropy is measured on held-out text (other sentences of the
same grammar), with the mean KL divergence of each quantised model's
next-character distribution from the float model's. The fraction of
round-to-nearest's loss gap that a method recovers is `(loss_rtn -
loss_method) / (loss_rtn - loss_float)`, and likewise for the KL divergence.
Where the gap is small the loss moves with the first-order effect of the
rounding, of either sign, and the KL divergence (second order, never negative)
is the steadier measure.

Run: `python benchmarks/calibration.py [--steps 300] [--bits 4 3 2]
[--group-size 64] [--calibration 8] [--quick]`. About four minutes on two busy
CPU cores for 4 and 3 bits, most of it compiling GPTQ per weight shape.
"""

import argparse
import time

import jax.numpy as jnp
from _language_model import divergence, LENGTH, log_probabilities, mean_loss

from quaxlike.demo import batches, build, full, sentences, train
from quaxlike.quantized import GPTQ, quantize


BATCH = 16


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calibration", type=int, default=8, help="batches of 16 windows")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["gptq", "gptq act-order", "awq"],
        choices=["gptq", "gptq act-order", "gptq sequential", "awq"],
        help="besides rtn",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke test: 20 steps, 4 bits")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.bits, args.calibration = 20, [4], 2
    start = time.perf_counter()

    text = sentences("animals", 600, 1) + sentences("machines", 600, 2)
    model, _, _ = train(build(seed=0), full, text, args.steps, 1e-2, 0)
    held_out_text = sentences("animals", 100, 3) + sentences("machines", 100, 4)
    held_out = jnp.concatenate([b for b, _ in zip(batches(held_out_text, LENGTH, 64, 5), range(4))])
    data = batches(text, LENGTH, BATCH, 6)
    calibration = [next(data)[:, :-1] for _ in range(args.calibration)]
    reference = log_probabilities(model, held_out)
    float_loss = mean_loss(reference, held_out)
    print(
        f"character transformer (width 128, 2 blocks), {args.steps} training steps; "
        f"held-out loss {float_loss:.4f} in float32; {len(calibration) * BATCH * LENGTH} "
        f"calibration tokens; groups of {args.group_size}"
    )
    methods = {
        "rtn": "rtn",
        "gptq": "gptq",
        "gptq act-order": GPTQ(act_order=True),
        "gptq sequential": GPTQ(sequential=True),
        "awq": "awq",
    }
    methods = {name: methods[name] for name in ["rtn", *args.methods]}
    print(
        "| bits | method | held-out loss | gap to float32 | of RTN's gap recovered "
        "| KL from float32 | of RTN's KL recovered | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for bits in args.bits:
        gaps, kls = {}, {}
        for name, method in methods.items():
            tic = time.perf_counter()
            data = None if method == "rtn" else calibration
            q = quantize(
                model, bits=bits, group_size=args.group_size, method=method, calibration=data
            )
            seconds = time.perf_counter() - tic
            log_p = log_probabilities(q, held_out)
            loss = mean_loss(log_p, held_out)
            gaps[name], kls[name] = loss - float_loss, divergence(reference, log_p)
            share = lambda d: "" if name == "rtn" else f"{1 - d[name] / d['rtn']:.0%}"  # noqa: E731
            print(
                f"| {bits} | {name} | {loss:.4f} | {gaps[name]:+.4f} | {share(gaps)} | "
                f"{kls[name]:.5f} | {share(kls)} | {seconds:.1f} |"
            )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
