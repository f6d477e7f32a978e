"""Trace cost in machine instructions: plain JAX against quaxlike, counted by
Valgrind's callgrind instead of timed.

On a shared machine the wall-clock ratios of `trace_time.py` and `nested.py`
move by several percent between runs, as much as the margins to their targets.
The number of instructions a trace executes does not depend on what else runs
on the machine: run twice, the ratios agree to within about 0.01 (the counts
to within about 1%, as the cases share caches). It is a proxy for
time (it ignores cache misses and memory stalls, which tracing has few of), so
this script answers "did a change make tracing cheaper, and by how much"
reproducibly; the timed scripts remain the measure the targets are stated in.

The same cases as `trace_time.py` (dense through the interpreter, LoRA against
hand-written) and `nested.py` (both orders of nesting, against one `quaxify`),
each sample a freshly built function as there, and the training step of
`scale.py`'s 1B-shaped decoder with LoRA against the same LoRA written by hand
(`jax.jit(step).trace` on abstract arguments; its "depth" column names the
model). All cases run in one Python
process under `valgrind --tool=callgrind`, with instrumentation switched on only
around the measured samples; each measured segment is closed by a callgrind
dump, and the cost of requesting a dump (measured on empty segments) is
subtracted. Without Valgrind the script says so and exits without measuring.

Run: `python benchmarks/instructions.py [--quick] [--repeats N]` (repeats:
samples per cell, default 3, at most 5; about eight minutes in all, half of
it the 1B step).
"""

import statistics
import sys

import _harness as h


_CHILD_FLAG = h.CALLGRIND_CHILD_FLAG
_callgrind = h.callgrind_control
# Samples per cell at most, whatever `--repeats` says (`run_all.py` passes on the
# timed scripts' 41): counts barely vary between samples, and each depth-32
# sample costs seconds under Valgrind.
_MAX_SAMPLES = 5
_SCALE = "LoRA step (scale.py)"
_TARGETS = {
    "dense": 1.10,
    "lora": 1.10,
    "nested, Zero outer": 1.05,
    "nested, LoRA outer": 1.05,
    _SCALE: 1.10,
}


def _cases(quick: bool):
    """(case, depth) pairs, in the order measured and printed."""
    if quick:
        return [
            ("dense", 2),
            ("lora", 2),
            ("nested, Zero outer", 2),
            ("nested, LoRA outer", 2),
            (_SCALE, "tiny"),
        ]
    return [
        ("dense", 8),
        ("dense", 32),
        ("lora", 8),
        ("lora", 32),
        ("nested, Zero outer", 32),
        ("nested, LoRA outer", 32),
        (_SCALE, "1b"),
    ]


def _factories(case: str, depth, width: int):
    """`(make_baseline, make_quaxlike)`: each call builds a fresh zero-argument
    callable that traces the case once."""
    import jax

    if case == _SCALE:
        import optax
        import scale
        from _decoder import SHAPES

        optimiser, shape = optax.adam(1e-4), SHAPES[depth]
        memory = scale.chunks_for(shape)  # scale.py's default chunks
        trace_hand, _ = scale.tracer(shape, scale.BASELINE, optimiser, memory)
        trace_lora, _ = scale.tracer(shape, scale.LORA, optimiser, memory)
        # Each call of `trace_*` traces a new `jax.jit` of a new step function.
        return (lambda: trace_hand), (lambda: trace_lora)
    if case in ("dense", "lora"):
        import trace_time

        return (trace_time.dense_case if case == "dense" else trace_time.lora_case)(depth, width)
    import nested

    model = nested.make_model(depth, width)
    x = h.array((width,))

    def tracing(make_wrapper):
        def make():
            f = make_wrapper()
            return lambda: jax.make_jaxpr(f)(model, x)

        return make

    outer = nested.zero_outer if case == "nested, Zero outer" else nested.lora_outer
    return tracing(nested.single), tracing(outer)


# --- inside Valgrind ----------------------------------------------------------


def _measure(quick: bool, samples: int, width: int) -> None:
    """Trace every case `samples` times per side, closing each side's segment
    with a callgrind dump named `case<index>:depth:side`."""
    import gc

    prepared = []
    for case, depth in _cases(quick):
        make_baseline, make_quaxlike = _factories(case, depth, width)
        for _ in range(2):  # warm JAX's caches (jnp functions' jaxprs, ...)
            make_baseline()()
            make_quaxlike()()
        prepared.append((case, depth, make_baseline, make_quaxlike))
    gc.collect()
    gc.freeze()
    _callgrind("--instr=on")
    _callgrind("--dump=start")
    for i in range(3):
        _callgrind(f"--dump=empty:{i}:-")
    for index, (case, depth, make_baseline, make_quaxlike) in enumerate(prepared):
        for side, make in (("baseline", make_baseline), ("quaxlike", make_quaxlike)):
            fns = [make() for _ in range(samples)]  # built outside the segment
            _callgrind("--dump=skip")
            for fn in fns:
                fn()
            _callgrind(f"--dump=case{index}:{depth}:{side}")
            del fns
    _callgrind("--instr=off")


# --- outside -----------------------------------------------------------------


def _read_dumps(totals: dict[str, int]) -> dict[tuple[str, str, str], int]:
    """The instructions of each `case:depth:side` dump."""
    return {tuple(name.split(":")): n for name, n in totals.items() if name.count(":") == 2}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    child = _CHILD_FLAG in argv
    if child:
        argv.remove(_CHILD_FLAG)
    args = h.parse_args(__doc__.splitlines()[0], argv, default_repeats=3)
    width = 16 if args.quick else 256
    samples = max(1, min(args.repeats, _MAX_SAMPLES))
    if child:
        _measure(args.quick, samples, width)
        return

    missing = h.callgrind_missing()
    notes = [
        "instructions per trace (millions), counted by valgrind --tool=callgrind; "
        f"{samples} sample(s) per cell, each a freshly built function; width {width}",
        "baseline: plain JAX for dense and lora (as in trace_time.py), "
        "one quaxify for nested (as in nested.py), the hand-written LoRA for the "
        "LoRA step (as in scale.py)",
    ]
    if missing:
        h.print_header("instructions: trace cost counted, not timed", args, notes)
        print(f"Not measured: {' and '.join(missing)} not found (Debian package `valgrind`).\n")
        return

    counts = _read_dumps(h.callgrind_totals(__file__, argv, "quaxlike-callgrind-"))

    empty = [n for (case, _, _), n in counts.items() if case == "empty"]
    overhead = statistics.median(empty) if empty else 0
    h.print_header("instructions: trace cost counted, not timed", args, notes)
    table = h.Table(
        "Instructions per trace",
        ["case", "depth", "baseline", "quaxlike", "ratio", "target (time)"],
    )
    for index, (case, depth) in enumerate(_cases(args.quick)):
        base, quax = (
            (counts[(f"case{index}", str(depth), side)] - overhead) / samples
            for side in ("baseline", "quaxlike")
        )
        ratio = quax / base
        table.add(
            case,
            depth,
            f"{base / 1e6:.2f} M",
            f"{quax / 1e6:.2f} M",
            f"{ratio:.3f}",
            h.at_most(ratio, _TARGETS[case]),
        )
    table.print(
        [
            f"(each cell less {overhead / 1e6:.2f} M instructions: the cost of asking "
            "callgrind for a dump, measured on empty segments)"
        ]
    )


if __name__ == "__main__":
    main()
