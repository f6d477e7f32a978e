"""Soak: a long LoRA and QLoRA training loop as a long-running program writes it,
with resident memory and every cache's size over time, beside plain JAX.

Every step builds a new `jax.jit` closure over its batch (as
`jax.jit(partial(loss, batch))` in a training loop does), the batch size cycles
through a few hundred sizes, and now and then a rule is registered (for a type
the loop does not use: it empties every cache that depends on the rules). The
model is a stack of `eqx.nn.Linear` + relu layers, LoRA rank 4:

- quaxlike LoRA: `loraify(model)`; quaxlike QLoRA: `qlora(model, bits=4)`; each
  step is `jax.value_and_grad` of `quaxify(jax.jit(partial(loss, xs, ys)))`
  with respect to the factors, then one jitted `optax.adam` update;
- plain JAX: the same loop on the same leaves written by hand
  (`stop_gradient(W) @ x + A @ (B @ x) + bias`; for QLoRA `W @ x` on the 4-bit
  codes, `_plain_quantized.blocked`).

Printed: resident set size (RSS, from /proc/self/status) at checkpoints for
every loop, each loop's growth over the first cycle of batch sizes (every step
a new shape: JAX's own per-shape caches fill) and over the rest (shapes seen
before: what a long run keeps adding), and every cache's entries in the
quaxlike loops. Each loop runs in its own process (with `--quick`, all in this
one). Every step compiles a new program, on both sides, as such a loop does:
half a second to a second of CPU per step on two cores, so the default (400
steps per loop, 1,600 in all, 200 sizes) takes 20 to 50 minutes;
`--steps 240 --sizes 80` about half that; `--loops QLoRA` runs some loops only.

Run: `python benchmarks/soak.py [--quick] [--steps N] [--sizes N] [--loops A,B]`.
"""

import argparse
import functools as ft
import gc
import json
import os
import subprocess
import sys
import time

import _harness as h
import _plain_quantized as plain
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import quaxlike
from quaxlike import _quaxify, _rules, _staging, _sub_programs, _values
from quaxlike._higher_order import _eager_operators, _jit
from quaxlike.lora import LoraArray, loraify, partition, qlora
from quaxlike.quantized._matmul import block_rows


RANK = 4


def rss_bytes() -> int:
    """The process's resident set size now (not its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cache_sizes() -> dict[str, int]:
    """Entries in every cache and memo of docs/caches.md that can grow."""
    bodies = _jit._bodies
    others = [c for c in list(_staging.all_compiled_calls) if c is not bodies]
    return {
        "plans": len(_rules._plans),
        "jit bodies": len(bodies),
        "cached_rule": sum(map(len, others)),
        "verdicts": len(_sub_programs.verdicts),
        "eager verdicts": len(_eager_operators._applies),
        "compiled calls": len(_sub_programs._compiled_calls),
        "types": len(_values._is_value_type) + sum(map(len, _staging._array_types.values())),
        "flat": len(_quaxify._flat_structures),
    }


BOUNDS = {
    "jit bodies": _jit._bodies.max_size,
    "eager verdicts": _eager_operators._MAX_VERDICTS,
}


def _lora_factors(model):
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_lora) if is_lora(x)]


def _quaxlike_loop(model, optimiser):
    trainable, frozen = partition(model)
    state = [trainable, optimiser.init(trainable)]

    def loss(xs, ys, model):
        return h.mse(jax.vmap(model)(xs), ys)

    @jax.jit
    def update(trainable, opt_state, grads):
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state

    def step(xs, ys):
        batch_loss = quaxlike.quaxify(jax.jit(ft.partial(loss, xs, ys)))  # new each step
        trainable, opt_state = state
        value, grads = jax.value_and_grad(lambda t: batch_loss(eqx.combine(t, frozen)))(trainable)
        state[:] = update(trainable, opt_state, grads)
        return value

    return step


def _plain_loop(params, forward, optimiser):
    trainable = [(a, b) for _, a, b, _ in params]
    frozen = [(w, bias) for w, _, _, bias in params]
    state = [trainable, optimiser.init(trainable)]

    def loss(xs, ys, trainable):
        layers = [(w, a, b, bias) for (a, b), (w, bias) in zip(trainable, frozen)]
        return h.mse(jax.vmap(lambda x: forward(layers, x))(xs), ys)

    @jax.jit
    def update(trainable, opt_state, grads):
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    def step(xs, ys):
        batch_loss = jax.jit(ft.partial(loss, xs, ys))  # new each step
        trainable, opt_state = state
        value, grads = jax.value_and_grad(batch_loss)(trainable)
        state[:] = update(trainable, opt_state, grads)
        return value

    return step


def _hand_lora(layers, x):
    for w, a, b, bias in layers:
        x = jax.nn.relu(jax.lax.stop_gradient(w) @ x + a @ (b @ x) + bias)
    return x


def _hand_qlora(rows, layers, x):
    for leaves, a, b, bias in layers:
        base = plain.blocked("int4", jax.lax.stop_gradient(leaves), x[None], rows)[0]
        x = jax.nn.relu(base + a @ (b @ x) + bias)
    return x


def make_loops(depth: int, width: int):
    optimiser = optax.adam(1e-3)
    dense = h.make_stack(depth, width)
    key = jr.key(1)
    lora = h.random_b(loraify(dense, rank=RANK, key=key, scale=0.1))
    q4 = h.random_b(qlora(dense, bits=4, rank=RANK, key=key, scale=0.1))
    lora_params = [
        (x.w, x.a, x.b, layer.bias) for x, layer in zip(_lora_factors(lora), lora.layers)
    ]
    q4_loras = _lora_factors(q4)
    rows = block_rows(q4_loras[0].w)[1]
    q4_params = [
        (plain.leaves_of(x.w), x.a, x.b, layer.bias) for x, layer in zip(q4_loras, q4.layers)
    ]
    loops = {
        "quaxlike LoRA": _quaxlike_loop(lora, optimiser),
        "plain JAX LoRA": _plain_loop(lora_params, _hand_lora, optimiser),
        "quaxlike QLoRA int4": _quaxlike_loop(q4, optimiser),
        "plain JAX QLoRA int4": _plain_loop(q4_params, ft.partial(_hand_qlora, rows), optimiser),
    }
    assert list(loops) == LOOPS
    return loops


LOOPS = ["quaxlike LoRA", "plain JAX LoRA", "quaxlike QLoRA int4", "plain JAX QLoRA int4"]


class _Unused(quaxlike.ArrayValue):
    """A type the loops never use: registering a rule for it only empties the
    caches that depend on the rules."""

    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


def _register_a_rule() -> None:
    @quaxlike.register(jax.lax.sin_p)
    def sin_p_unused(x: _Unused, **params):
        return jnp.sin(x.array)


def run_loop(name, step, *, steps, sizes, width, checkpoints, register_every):
    """Run `steps` steps of `step`: `[(step, rss, cache sizes)]` at
    `checkpoints` evenly spaced steps, the last loss, and seconds per step."""
    xs_all = h.array((sizes, width), seed=2)
    ys_all = h.array((sizes, width), seed=3)
    marks = {round(i * (steps - 1) / (checkpoints - 1)) for i in range(checkpoints)}
    marks.add(min(sizes, steps) - 1)  # every batch size seen once: the end of the first cycle
    record, value = [], None
    start = time.perf_counter()
    for i in range(steps):
        n = 1 + (i * 37) % sizes  # cycles through every batch size in 1..sizes
        value = step(xs_all[:n], ys_all[:n])
        if register_every and i % register_every == register_every - 1:
            _register_a_rule()
        if i in marks:
            jax.block_until_ready(value)
            gc.collect()
            record.append((i + 1, rss_bytes(), cache_sizes()))
    seconds = (time.perf_counter() - start) / steps
    return record, float(value), seconds  # pyright: ignore[reportArgumentType]


def _run_in_child(name: str, argv: list[str]) -> tuple[list, float, float]:
    """`run_loop` for loop `name` in a fresh Python process (so that each loop's
    resident memory is its own), read back as JSON."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, "--loop", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    record, loss, seconds = json.loads(out.strip().splitlines()[-1])
    return [tuple(r) for r in record], loss, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    parser.add_argument("--steps", type=int, default=None, help="steps per loop")
    parser.add_argument("--sizes", type=int, default=None, help="batch sizes cycled through")
    parser.add_argument("--repeats", type=int, default=None, help="ignored (run_all passes it)")
    parser.add_argument("--cold", action="store_true", help="ignored (run_all passes it)")
    parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)  # a child's one loop
    parser.add_argument(
        "--loops", default=None, help="run only the loops whose names contain one of these (a,b)"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (6 if args.quick else 400)
    sizes = args.sizes or (3 if args.quick else 200)
    depth, width = 1, 32
    checkpoints = 3 if args.quick else 9
    register_every = 3 if args.quick else 100
    settings = dict(
        steps=steps,
        sizes=sizes,
        width=width,
        checkpoints=checkpoints,
        register_every=register_every,
    )
    if args.loop is not None:
        step = make_loops(depth, width)[args.loop]
        print(json.dumps(run_loop(args.loop, step, **settings)))
        return
    args.repeats = 0
    h.print_header(
        "Soak: long training loops, resident memory and cache sizes",
        args,
        [
            f"{steps} steps per loop, a new jitted closure over each batch, batch sizes "
            f"cycling through 1..{sizes}, a rule registered every {register_every} steps; "
            f"{depth} layer of width {width}, LoRA rank {RANK}; "
            + ("all loops in this process" if args.quick else "each loop in its own process"),
        ],
    )
    names = [n for n in LOOPS if not args.loops or any(w in n for w in args.loops.split(","))]
    loops = make_loops(depth, width) if args.quick else {}
    child_argv = ["--steps", str(steps), "--sizes", str(sizes)]
    growth = h.Table(
        "Soak: resident memory growth over the run",
        [
            "loop",
            "RSS after step 1",
            f"growth, steps 1-{min(sizes, steps)} (first cycle of sizes)",
            f"growth, steps {min(sizes, steps)}-{steps} (sizes seen before)",
            "RSS at end",
            "time per step",
            "last loss",
        ],
    )
    caches = h.Table(
        "Soak: cache entries over the run (quaxlike loops)",
        ["loop", "step", "RSS", *cache_sizes()],
    )
    over_time: dict[str, list] = {}
    for name in names:
        if args.quick:
            record, loss, seconds = run_loop(name, loops[name], **settings)
        else:
            record, loss, seconds = _run_in_child(name, child_argv)
        over_time[name] = record
        cycle = next(r for r in record if r[0] >= min(sizes, steps))
        growth.add(
            name,
            h.fmt_bytes(record[0][1]),
            h.fmt_bytes(cycle[1] - record[0][1]),
            h.fmt_bytes(record[-1][1] - cycle[1]),
            h.fmt_bytes(record[-1][1]),
            h.fmt_time(seconds),
            f"{loss:.4g}",
        )
        if name.startswith("quaxlike"):
            for at, rss, sizes_now in record:
                caches.add(name, at, h.fmt_bytes(rss), *sizes_now.values())
                for cache, bound in BOUNDS.items():
                    if sizes_now[cache] > bound:
                        print(f"WARNING: {cache} holds {sizes_now[cache]} > its bound {bound}")
    rss = h.Table("Soak: resident memory over the run", ["step", *over_time])
    for i, (at, _, _) in enumerate(next(iter(over_time.values()))):
        rss.add(at, *(h.fmt_bytes(record[i][1]) for record in over_time.values()))
    rss.print()
    growth.print()
    caches.print(
        [
            f"Bounds: {', '.join(f'{k} {v}' for k, v in BOUNDS.items())}; the others grow "
            "with the number of types and primitives, not with steps or shapes "
            "(docs/caches.md). Sizes are read after `gc.collect()`."
        ]
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
