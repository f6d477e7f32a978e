"""Peak memory and run time of a quantised model against the dense float32 one:
forward, `jax.grad`, `lax.scan` over stacked layers and `jax.vmap` over layers.

The model is a stack of `depth` `eqx.nn.Linear(width, width)` + relu layers (8 of
width 1024: 32 MiB of float32 weights), on a batch of 8. Every program is
`jax.jit`-compiled with XLA's default flags:

- forward: `jax.vmap(model)(xs)`;
- grad: `jax.grad` of `sum(forward)` with respect to `xs` (the backward pass takes
  every layer's transposed product);
- scan: the layers' weights stacked into one `(depth, width, width)` array (and
  quantised as one), applied by `lax.scan`;
- vmap: the stacked weights applied to `depth` separate batches at once, by
  `jax.vmap` over the layer axis.

Rows: the dense float32 model; quaxlike's `quantize(model, bits=8 | 4)` (called
through `quaxify`); and the same quantised leaves used by plain JAX written by
hand (`_plain_quantized.py`): dequantised whole per layer ("naive"), or block by
block as quaxlike's rule does ("blocked", with the same blocks).

Peak is `memory_analysis()`'s arguments + outputs + temporaries - aliased bytes
(exact, so measured once). Time is the median of interleaved runs against the
dense program, with the paired ratios' spread. Then: forward peak and time
against the block size (`block_bytes`), and what each part of the blocked
product buys (plain JAX, 4 bits).

Run: `python benchmarks/quantized.py [--quick] [--repeats N]`.
"""

import functools as ft

import _harness as h
import _plain_quantized as plain
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import quaxlike
from quaxlike.quantized import quantize, quantize_int4, quantize_int8
from quaxlike.quantized._matmul import block_rows


KINDS = ("int8", "int4")
TARGETS = {  # (peak, time) against dense, for the forward pass
    "int8": (0.30, 1.5),
    "int4": (0.20, 1.5),
}


def quantized(kind, w, **options):
    if kind == "int8":
        return quantize_int8(w, **options)
    return quantize_int4(w, group_size=32, **options)


# --- the programs --------------------------------------------------------------


def dense_stack(weights, biases, xs):
    for w, b in zip(weights, biases):
        xs = jax.nn.relu(xs @ w.T + b)
    return xs


def quax_stack(model, xs):
    return jax.vmap(quaxlike.quaxify(model))(xs)


def hand_stack(product, weights, biases, xs):
    for leaves, b in zip(weights, biases):
        xs = jax.nn.relu(product(leaves, xs) + b)
    return xs


def scan_layers(matmul, ws, bs, xs):
    def layer(xs, wb):
        w, b = wb
        return jax.nn.relu(matmul(w, xs) + b), None

    return lax.scan(layer, xs, (ws, bs))[0]


def vmap_layers(matmul, ws, bs, xs):
    return jax.vmap(lambda w, b, x: jax.nn.relu(matmul(w, x) + b))(ws, bs, xs)


def grad_of(forward):
    return lambda params, xs: jax.grad(lambda xs: jnp.sum(forward(params, xs)))(xs)


def make_cases(depth, width, batch):
    """{case: {row: (function, arguments)}}, every function taking its arguments."""
    mlp = h.make_stack(depth, width)
    weights = [layer.weight for layer in mlp.layers]
    biases = [layer.bias for layer in mlp.layers]
    stacked_w, stacked_b = jnp.stack(weights), jnp.stack(biases)
    xs = h.array((batch, width), seed=2)
    per_layer_xs = h.array((depth, batch, width), seed=3)

    forward = {"dense float32": (lambda p, xs: dense_stack(*p, xs), ((weights, biases), xs))}
    scan = {"dense float32": (ft.partial(scan_layers, lambda w, x: x @ w.T), None)}
    vmapped = {"dense float32": (ft.partial(vmap_layers, lambda w, x: x @ w.T), None)}
    for kind in KINDS:
        model = quantize(mlp, bits=8 if kind == "int8" else 4, group_size=32)
        forward[f"quaxlike {kind}"] = (quax_stack, (model, xs))
        leaves = [plain.leaves_of(layer.weight) for layer in model.layers]
        rows = block_rows(model.layers[0].weight)[1]
        for name, product in (
            ("naive", ft.partial(plain.naive, kind)),
            ("blocked", ft.partial(plain.blocked, kind, rows=rows)),
        ):
            forward[f"plain {kind} {name}"] = (
                lambda p, xs, product=product: hand_stack(product, *p, xs),
                ((leaves, biases), xs),
            )
        q_stacked = quantized(kind, stacked_w)
        matmul = lambda w, x: x @ w.T  # noqa: E731
        scan[f"quaxlike {kind}"] = (quaxlike.quaxify(ft.partial(scan_layers, matmul)), q_stacked)
        vmapped[f"quaxlike {kind}"] = (
            quaxlike.quaxify(ft.partial(vmap_layers, matmul)),
            q_stacked,
        )
        for name in ("naive", "blocked"):
            product = (
                ft.partial(plain.naive, kind)
                if name == "naive"
                else ft.partial(plain.blocked, kind, rows=rows)
            )
            matmul = lambda w, x, product=product: product(plain.leaves_of(w), x)  # noqa: E731
            scan[f"plain {kind} {name}"] = (ft.partial(scan_layers, matmul), q_stacked)
            vmapped[f"plain {kind} {name}"] = (ft.partial(vmap_layers, matmul), q_stacked)

    def stacked_args(weights):
        return (stacked_w if weights is None else weights, stacked_b)

    cases = {
        "forward": forward,
        "grad": {row: (grad_of(f), args) for row, (f, args) in forward.items()},
        "scan": {
            row: (lambda w, b, xs, f=f: f(w, b, xs), (*stacked_args(w), xs))
            for row, (f, w) in scan.items()
        },
        "vmap": {
            row: (lambda w, b, xs, f=f: f(w, b, xs), (*stacked_args(w), per_layer_xs))
            for row, (f, w) in vmapped.items()
        },
    }
    return cases


# --- measuring -----------------------------------------------------------------


def compiled_case(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, h.peak_bytes(compiled)


def timed(compiled_dense, dense_args, compiled, args, repeats, calls):
    for _ in range(2):
        jax.block_until_ready((compiled_dense(*dense_args), compiled(*args)))
    return h.interleaved(
        lambda: h.per_call(lambda: compiled_dense(*dense_args), calls),
        lambda: h.per_call(lambda: compiled(*args), calls),
        repeats,
    )


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=15)
    depth, width, batch = (2, 64, 2) if args.quick else (8, 1024, 8)
    calls = 1 if args.quick else 5
    cases = make_cases(depth, width, batch)

    # Every row computes what the dense program computes on the dequantised
    # weights: checked against the plain naive row (the dequantised weights).
    agree = True
    for case, rows in cases.items():
        if args.quick and case != "forward":
            continue
        outputs = {row: jax.jit(f)(*a) for row, (f, a) in rows.items()}
        for kind in KINDS if not args.quick else ():
            reference = outputs[f"plain {kind} naive"]
            for row, out in outputs.items():
                if kind in row:
                    agree &= bool(np.allclose(out, reference, rtol=1e-4, atol=1e-4))
    h.print_header(
        "quantized: peak memory and run time of a quantised model against dense float32",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu, depth {depth}, batch {batch}; "
            f"int4 group size 32; default block_bytes; {calls} calls per timed sample",
            "peak = arguments + outputs + temporaries - aliased (memory_analysis())",
            f"every quantised row gives what plain JAX gives on the dequantised weights: {agree}",
        ],
    )

    if args.quick:  # the smoke test: one table, the quaxlike rows
        cases = {"forward": {r: p for r, p in cases["forward"].items() if "plain" not in r}}
    for case, rows in cases.items():
        table = h.Table(
            f"Quantised model, {case}",
            ["program", "peak", "peak / dense", "time", "time / dense", "paired IQR", "target"],
        )
        dense_fn, dense_args = rows["dense float32"]
        compiled_dense, dense_peak = compiled_case(dense_fn, dense_args)
        for row, (fn, row_args) in rows.items():
            compiled, peak = compiled_case(fn, row_args)
            paired = timed(compiled_dense, dense_args, compiled, row_args, args.repeats, calls)
            kind = next((k for k in KINDS if row == f"quaxlike {k}"), None)
            target = "-"
            if kind is not None and case == "forward":
                peak_target, time_target = TARGETS[kind]
                target = (
                    f"peak {h.at_most(peak / dense_peak, peak_target)}, "
                    f"time {h.at_most(paired.ratio, time_target)}"
                )
            table.add(
                row,
                h.fmt_bytes(peak),
                f"{peak / dense_peak:.3f}",
                h.fmt_time(paired.quax_median / calls),
                f"{paired.ratio:.2f}",
                paired.spread(),
                target,
            )
        table.print()

    if not args.quick:
        block_sizes(depth, width, batch, args, calls)
        steps(depth, width, batch, args, calls)


def block_sizes(depth, width, batch, args, calls):
    """Forward peak and time against `block_bytes`."""
    mlp = h.make_stack(depth, width)
    xs = h.array((batch, width), seed=2)
    dense_args = (mlp, xs)
    compiled_dense, dense_peak = compiled_case(lambda m, xs: jax.vmap(m)(xs), dense_args)
    table = h.Table(
        "Block size (forward)",
        ["block_bytes", "rows per block", "int8 peak / dense", "int8 time / dense"]
        + ["int4 peak / dense", "int4 time / dense"],
    )
    sizes = (2**12, 2**14) if args.quick else (2**17, 2**18, 2**19, 2**20, 2**21)
    for size in sizes:
        cells = []
        for bits in (8, 4):
            model = quantize(mlp, bits=bits, group_size=32, block_bytes=size)
            compiled, peak = compiled_case(quax_stack, (model, xs))
            paired = timed(compiled_dense, dense_args, compiled, (model, xs), args.repeats, calls)
            cells += [f"{peak / dense_peak:.3f}", f"{paired.ratio:.2f} ({paired.spread()})"]
        rows = block_rows(quantize(mlp, bits=8, block_bytes=size).layers[0].weight)[1]
        table.add(h.fmt_bytes(size), rows, *cells)
    table.print(
        [
            "Each step of the loop dequantises one block of whole rows (at least two blocks per "
            "weight); the default is 512 KiB."
        ]
    )


def steps(depth, width, batch, args, calls):
    """What each part of the blocked product buys, in plain JAX at 4 bits."""
    mlp = h.make_stack(depth, width)
    model = quantize(mlp, bits=4, group_size=32)
    leaves = [plain.leaves_of(layer.weight) for layer in model.layers]
    biases = [layer.bias for layer in mlp.layers]
    xs = h.array((batch, width), seed=2)
    rows = block_rows(model.layers[0].weight)[1]
    dense_args = (([layer.weight for layer in mlp.layers], biases), xs)
    variants = {
        "dequantise whole, then multiply": ft.partial(plain.naive, "int4"),
        "+ blocks of rows in a lax.scan": ft.partial(
            plain.blocked, "int4", rows=rows, checkpoint=False, phases=False
        ),
        "+ jax.checkpoint on each step": ft.partial(plain.blocked, "int4", rows=rows, phases=False),
        "+ even and odd columns apart (quaxlike's rule)": ft.partial(
            plain.blocked, "int4", rows=rows
        ),
    }
    table = h.Table(
        "What each step buys (plain JAX, int4)",
        ["program", "forward peak", "forward time", "grad peak", "grad time"],
    )
    dense_forward = lambda p, xs: dense_stack(*p, xs)  # noqa: E731
    compiled = {
        "forward": compiled_case(dense_forward, dense_args),
        "grad": compiled_case(grad_of(dense_forward), dense_args),
    }
    for name, product in variants.items():
        forward = lambda p, xs, product=product: hand_stack(product, *p, xs)  # noqa: E731
        cells = []
        for label, fn in (("forward", forward), ("grad", grad_of(forward))):
            compiled_dense, dense_peak = compiled[label]
            c, peak = compiled_case(fn, ((leaves, biases), xs))
            paired = timed(
                compiled_dense, dense_args, c, ((leaves, biases), xs), args.repeats, calls
            )
            cells += [f"{peak / dense_peak:.3f}", f"{paired.ratio:.2f}"]
        table.add(name, *cells)
    table.print(["Ratios against the dense float32 model's forward or grad program."])


if __name__ == "__main__":
    main()
