"""Trace time: `jax.make_jaxpr(quaxify(f))` against `jax.make_jaxpr(f)`.

The model is a stack of `eqx.nn.Linear(width, width)` layers, each followed by a
relu, at several depths.

- dense: every weight and bias is wrapped in a `quaxlike.DenseArrayValue`, so
  `quaxify` lifts them all and every operation runs through the interpreter
  (`quaxify(f, filter_spec=eqx.is_array)` would not do that: `filter_spec` only
  selects Values, and plain arrays are never lifted, so on a dense model it calls
  `f` directly). Against `make_jaxpr(f)` on the plain model.
- lora: `loraify(model, rank=8)` run with `quaxify`, against the same maths written
  by hand in JAX: `stop_gradient(W) @ x + A @ (B @ x) + bias` per layer.

Each sample traces a freshly built function (and a fresh `quaxify` wrapper), so
JAX's tracing cache never answers. The equation counts include the equations of
every sub-jaxpr (relu's custom_jvp body, ...).

Run: `python benchmarks/trace_time.py [--quick] [--repeats N] [--cold]`.
"""

import _harness as h
import jax
import jax.random as jr
import numpy as np

import quaxlike
from quaxlike.lora import loraify


TARGET = 1.10
RANK = 8


def dense_case(depth, width):
    model = h.make_stack(depth, width)
    values = h.dense_values(model)
    x = h.array((width,))

    def make_plain():
        f = lambda m, x: m(x)  # noqa: E731  (a new function object every sample)
        return lambda: jax.make_jaxpr(f)(model, x)

    def make_quax():
        f = quaxlike.quaxify(lambda m, x: m(x))
        return lambda: jax.make_jaxpr(f)(values, x)

    return make_plain, make_quax


def lora_case(depth, width):
    model = loraify(h.make_stack(depth, width), rank=RANK, key=jr.key(1), scale=0.1)
    params = h.lora_layers(model)
    x = h.array((width,))

    def make_plain():
        f = lambda p, x: h.hand_lora_stack(p, x)  # noqa: E731
        return lambda: jax.make_jaxpr(f)(params, x)

    def make_quax():
        f = quaxlike.quaxify(lambda m, x: m(x))
        return lambda: jax.make_jaxpr(f)(model, x)

    return make_plain, make_quax


def check_lora_outputs(width):
    model = h.random_b(loraify(h.make_stack(2, width), rank=RANK, key=jr.key(1), scale=0.1))
    x = h.array((width,))
    got = jax.jit(quaxlike.quaxify(lambda m, x: m(x)))(model, x)
    want = jax.jit(h.hand_lora_stack)(h.lora_layers(model), x)
    return bool(np.allclose(got, want, rtol=1e-4, atol=1e-4))


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv)
    depths = (2, 4) if args.quick else (8, 32, 128)
    width = 16 if args.quick else 256
    h.print_header(
        "trace_time: make_jaxpr(quaxify(f)) vs make_jaxpr(f)",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu; LoRA rank {RANK}",
            "dense: weights and biases wrapped in quaxlike.DenseArrayValue, quaxify(f) with the "
            "default filter_spec=True (filter_spec=eqx.is_array lifts nothing on plain arrays)",
            "lora: loraify(model) vs hand-written stop_gradient(W) @ x + A @ (B @ x) + bias",
            f"LoRA outputs equal hand-written (depth 2): {check_lora_outputs(width)}",
        ],
    )
    table = h.Table(
        "Trace time",
        [
            "case",
            "depth",
            "plain JAX",
            "quaxlike",
            "ratio",
            "paired IQR",
            "target",
            "eqns plain",
            "eqns quaxlike",
        ],
    )
    for name, case in (
        ("dense (DenseArrayValue)", dense_case),
        ("lora (vs hand-written)", lora_case),
    ):
        for depth in depths:
            make_plain, make_quax = case(depth, width)
            eqns_plain = h.count_eqns(make_plain()())
            eqns_quax = h.count_eqns(make_quax()())
            paired = h.interleaved(make_plain, make_quax, args.repeats, cold=args.cold)
            table.add(
                name,
                depth,
                *paired.cells(),
                h.at_most(paired.ratio, TARGET),
                eqns_plain,
                f"{eqns_quax} ({'ok' if eqns_quax <= eqns_plain else 'over'})",
            )
    table.print()


if __name__ == "__main__":
    main()
