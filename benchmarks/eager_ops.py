"""Eager per-operation cost (no `jit`): a `quaxify`-wrapped operation on Values
against the same operation in plain JAX.

- add: `quaxify(lambda x, y: x + y)(DenseArrayValue(x), DenseArrayValue(y))`
  against `x + y`;
- matmul: `quaxify(lambda x, w: x @ w)(DenseArrayValue(x), DenseArrayValue(w))`
  against `x @ w`;
- lora matvec: `quaxify(lambda w, x: w @ x)(lora, x)` for a `LoraArray` of rank 8,
  against `stop_gradient(W) @ x + A @ (B @ x)` run eagerly;
- lora matvec, compile_eagerly: the same with a `LoraArray` subclass that sets
  the opt-in `compile_eagerly = True`: `jnp.matmul` then runs as one cached
  compiled call with the rule traced into it, instead of the rule's three
  products op by op on concrete arrays (the default, faithful to Quax);
- units: `quaxify(lambda a, b: jnp.sum((a - b) ** 2))` on two `Unitful`
  lengths in km and m (the subtraction's rule converts units; `** 2` squares
  the unit), against the same arithmetic on the arrays. Unitful's own rule for
  `jit` evaluates every call op by op (it tracks constants), so the opt-in does
  not apply to it.

add and matmul go through the default rule, which only materialises: eagerly
the call runs as JAX runs it on the dense arrays, in either mode.

Everything is called a few times first (the first eager call of an operation
compiles it); then each sample times a batch of calls, blocked on the last
result, and reports the time per call. The `quaxify` wrapper is built once:
this measures the steady state, not tracing.

Run: `python benchmarks/eager_ops.py [--quick] [--repeats N]`.
"""

import _harness as h
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import quaxlike
from quaxlike.examples.lora import LoraArray
from quaxlike.examples.unitful import km, m, Unitful


class CompiledLoraArray(LoraArray):
    """`LoraArray` with the opt-in to compiled eager calls."""

    compile_eagerly = True


TARGET = 5.0
RANK = 8


def cases(width):
    x = h.array((width,), seed=1)
    y = h.array((width,), seed=2)
    w = h.array((width, width), seed=3)
    dx, dy, dw = (quaxlike.DenseArrayValue(v) for v in (x, y, w))

    add_q = quaxlike.quaxify(lambda x, y: x + y)
    mat_q = quaxlike.quaxify(lambda x, w: x @ w)
    lora = h.random_b(LoraArray(w, rank=RANK, key=jr.key(4), scale=0.1))
    lora_q = quaxlike.quaxify(lambda w, x: w @ x)
    W, A, B = lora.w, lora.a, lora.b

    def lora_plain():
        return jax.lax.stop_gradient(W) @ x + A @ (B @ x)

    def distance(a, b):
        return jnp.sum((a - b) ** 2)

    distance_q = quaxlike.quaxify(distance)
    ua, ub = Unitful(x, km), Unitful(y, m)
    compiled_lora = h.random_b(CompiledLoraArray(w, rank=RANK, key=jr.key(4), scale=0.1))

    def units_plain():
        return distance(x, y / 1000)

    return [
        ("add `x + y`", lambda: x + y, lambda: add_q(dx, dy)),
        ("matmul `x @ w`", lambda: x @ w, lambda: mat_q(dx, dw)),
        ("lora matvec `w @ x`", lora_plain, lambda: lora_q(lora, x)),
        ("lora matvec, compile_eagerly", lora_plain, lambda: lora_q(compiled_lora, x)),
        ("units `sum((a - b) ** 2)`", units_plain, lambda: distance_q(ua, ub).array),
    ]


def main(argv=None):
    args = h.parse_args(__doc__.splitlines()[0], argv)
    width = 16 if args.quick else 256
    calls = 5 if args.quick else 200
    all_cases = cases(width)
    same = all(np.allclose(plain(), quax(), rtol=1e-4, atol=1e-4) for _, plain, quax in all_cases)
    h.print_header(
        "eager_ops: eager quaxify(op) on Values vs the plain JAX op",
        args,
        [
            f"x, y: f32[{width}], w: f32[{width},{width}], LoRA rank {RANK}; "
            f"{calls} calls per sample, time per call reported",
            "add and matmul: operands wrapped in quaxlike.DenseArrayValue (default rule: "
            "materialise and bind)",
            f"outputs equal plain JAX: {same}",
        ],
    )
    table = h.Table(
        "Eager per-op cost",
        ["operation", "plain JAX", "quaxlike", "ratio", "paired IQR", "target"],
    )
    for name, plain, quax in all_cases:
        for _ in range(3):  # compile and warm up both
            jax.block_until_ready((plain(), quax()))
        paired = h.interleaved(
            lambda: h.per_call(plain, calls),
            lambda: h.per_call(quax, calls),
            args.repeats,
            cold=False,
        )
        # The target is for the operations through the default rule; the units
        # rows report what faithful eager costs and what the opt-in gains.
        target = (
            "-"
            if name.startswith(("units", "lora matvec,"))
            else h.at_most(paired.ratio, TARGET, digits=0)
        )
        table.add(name, *paired.cells(calls), target)
    table.print()


if __name__ == "__main__":
    main()
