"""Compile time and run time of a jit-compiled LoRA model, against the same
maths written by hand in JAX, and whether XLA ends up with the same program.

The model is a stack of `eqx.nn.Linear(width, width)` + relu layers, `loraify`d
with rank 8, applied to a batch with `jax.vmap`:

- quaxlike: `jax.jit(lambda m, xs: jax.vmap(lambda x: quaxify(m)(x))(xs))`;
- plain: `jax.jit(lambda p, xs: jax.vmap(lambda x: hand(p, x))(xs))`, where
  `hand` computes `stop_gradient(W) @ x + A @ (B @ x) + bias` and relu per layer.

Both sides hand `jax.vmap` a function. Given a callable object with no code of
its own (`jax.vmap(quaxify(m))`, or `jax.vmap(m)` in plain Equinox), JAX takes
`str()` of the object it wraps, the whole model, for its debug information on
every call: about 13 ms at depth 32, which is Equinox's printing, not tracing.

Rows:

- lower + compile: `jax.jit(f).lower(args).compile()` for a new function object
  each sample (tracing, lowering to StableHLO and XLA's compilation);
- XLA compile only: `lowered.compile()`, with a fresh lowering made outside the
  timing each sample;
- run: the compiled program called on the same arguments, steady state, time per
  call.

The compiled programs' texts (`compiled.as_text()`) are then compared after
removing names, source locations and other metadata.

Run: `python benchmarks/compile_run.py [--quick] [--repeats N] [--cold]`.
"""

import _harness as h
import jax
import jax.random as jr
import numpy as np

import quaxlike
from quaxlike.lora import loraify


RANK = 8
TARGET = 1.00


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=7)
    depth, width, batch = (2, 16, 4) if args.quick else (32, 256, 64)
    calls = 3 if args.quick else 20

    model = h.random_b(loraify(h.make_stack(depth, width), rank=RANK, key=jr.key(1), scale=0.1))
    params = h.lora_layers(model)
    xs = h.array((batch, width))

    def quax_fn():
        return lambda m, xs: jax.vmap(lambda x: quaxlike.quaxify(m)(x))(xs)

    def plain_fn():
        return lambda p, xs: jax.vmap(lambda x: h.hand_lora_stack(p, x))(xs)

    compiled_q = jax.jit(quax_fn()).lower(model, xs).compile()
    compiled_p = jax.jit(plain_fn()).lower(params, xs).compile()
    same_out = bool(
        np.allclose(compiled_q(model, xs), compiled_p(params, xs), rtol=1e-4, atol=1e-4)
    )
    same_hlo, hlo_summary = h.compare_hlo(compiled_p.as_text(), compiled_q.as_text())
    eqns_q = h.count_eqns(jax.make_jaxpr(quax_fn())(model, xs))
    eqns_p = h.count_eqns(jax.make_jaxpr(plain_fn())(params, xs))

    h.print_header(
        "compile_run: jit-compiled LoRA model vs the hand-written LoRA maths",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu, depth {depth}, LoRA rank {RANK}, "
            f"batch {batch} (jax.vmap); run: {calls} calls per sample",
            f"outputs equal: {same_out}; jaxpr equations: plain {eqns_p}, quaxlike {eqns_q}",
        ],
    )

    table = h.Table(
        "Compile and run",
        ["measure", "plain JAX", "quaxlike", "ratio", "paired IQR", "target"],
    )

    def add(name, paired, per=1):
        table.add(
            name,
            *paired.cells(per),
            f"{TARGET:.2f} within noise",
        )

    add(
        "lower + compile",
        h.interleaved(
            lambda: (lambda f: lambda: jax.jit(f).lower(params, xs).compile())(plain_fn()),
            lambda: (lambda f: lambda: jax.jit(f).lower(model, xs).compile())(quax_fn()),
            args.repeats,
            cold=args.cold,
        ),
    )
    add(
        "XLA compile only",
        h.interleaved(
            lambda: jax.jit(plain_fn()).lower(params, xs).compile,
            lambda: jax.jit(quax_fn()).lower(model, xs).compile,
            args.repeats,
            cold=False,
        ),
    )
    for _ in range(3):
        jax.block_until_ready((compiled_p(params, xs), compiled_q(model, xs)))
    add(
        "run (per call)",
        h.interleaved(
            lambda: h.per_call(lambda: compiled_p(params, xs), calls),
            lambda: h.per_call(lambda: compiled_q(model, xs), calls),
            args.repeats * 2,
        ),
        per=calls,
    )
    table.print([f"Optimised HLO (compiled.as_text(), names and metadata removed): {hlo_summary}"])


if __name__ == "__main__":
    main()
