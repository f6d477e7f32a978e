"""Nested `quaxify` against one `quaxify` handling both types: trace time.

The model is a stack of `eqx.nn.Linear(width, width)` + relu layers whose weights
are `LoraArray`s (rank 8) and whose biases are `Zero`s, so each layer is
`relu(W x + A (B x) + 0)`, and the `+ 0` disappears at trace time.

- single: `quaxify(f)`, lifting both types in one trace;
- nested, Zero outer: `quaxify(quaxify(f, filter_spec=is_lora), filter_spec=is_zero)`:
  the inner trace sees LoRA weights, the outer one the Zero biases;
- nested, LoRA outer: the reverse order.

Time is `jax.make_jaxpr` of a freshly built wrapper per sample; the ratio is
nested / single (both quaxlike; there is no plain-JAX side to this question). The
equation counts are compared with the hand-written
`relu(stop_gradient(W) @ x + A @ (B @ x))`.

Run: `python benchmarks/nested.py [--quick] [--repeats N] [--cold]`.
"""

import _harness as h
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import quaxlike
from quaxlike.lora import LoraArray, loraify
from quaxlike.symbolic.zero import Zero


RANK = 8
TARGET = 1.05


def is_lora(x):
    return isinstance(x, LoraArray)


def is_zero(x):
    return isinstance(x, Zero)


def make_model(depth, width):
    model = h.random_b(loraify(h.make_stack(depth, width), rank=RANK, key=jr.key(1), scale=0.1))
    zeros = [Zero((width,), jnp.float32) for _ in model.layers]
    return eqx.tree_at(lambda m: [layer.bias for layer in m.layers], model, zeros)


def hand(params, x):
    for w, a, b, _ in params:
        x = jax.nn.relu(jax.lax.stop_gradient(w) @ x + a @ (b @ x))
    return x


def single():
    return quaxlike.quaxify(lambda m, x: m(x))


def zero_outer():
    return quaxlike.quaxify(
        quaxlike.quaxify(lambda m, x: m(x), filter_spec=is_lora), filter_spec=is_zero
    )


def lora_outer():
    return quaxlike.quaxify(
        quaxlike.quaxify(lambda m, x: m(x), filter_spec=is_zero), filter_spec=is_lora
    )


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv)
    depths = (2,) if args.quick else (8, 32)
    width = 16 if args.quick else 256

    check_model = make_model(2, width)
    x = h.array((width,))
    want = hand(h.lora_layers(check_model), x)
    same = all(
        np.allclose(jax.jit(make())(check_model, x), want, rtol=1e-4, atol=1e-4)
        for make in (single, zero_outer, lora_outer)
    )
    h.print_header(
        "nested: quaxify(quaxify(f, LoRA), Zero) vs one quaxify(f)",
        args,
        [
            f"stack of eqx.nn.Linear({width}, {width}) + relu, LoraArray weights (rank {RANK}), "
            "Zero biases; make_jaxpr trace time",
            f"outputs of all three equal hand-written (depth 2): {same}",
        ],
    )
    table = h.Table(
        "Nested quaxify",
        [
            "nesting",
            "depth",
            "single quaxify",
            "nested",
            "ratio",
            "paired IQR",
            "target",
            "eqns hand",
            "eqns single",
            "eqns nested",
        ],
    )
    for depth in depths:
        model = make_model(depth, width)
        params = h.lora_layers(model)
        eqns_hand = h.count_eqns(jax.make_jaxpr(lambda p, x: hand(p, x))(params, x))
        eqns_single = h.count_eqns(jax.make_jaxpr(single())(model, x))
        for name, nested in (
            ("Zero outer, LoRA inner", zero_outer),
            ("LoRA outer, Zero inner", lora_outer),
        ):
            eqns_nested = h.count_eqns(jax.make_jaxpr(nested())(model, x))
            paired = h.interleaved(
                lambda: (lambda f: lambda: jax.make_jaxpr(f)(model, x))(single()),
                lambda: (lambda f: lambda: jax.make_jaxpr(f)(model, x))(nested()),
                args.repeats,
                cold=args.cold,
            )
            table.add(
                name,
                depth,
                *paired.cells(),
                h.at_most(paired.ratio, TARGET),
                eqns_hand,
                eqns_single,
                eqns_nested,
            )
    table.print()


if __name__ == "__main__":
    main()
