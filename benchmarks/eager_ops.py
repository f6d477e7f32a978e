"""Eager per-operation cost (no `jit`): operations on Values inside `quaxify`,
in quaxlike and in Quax side by side, against plain JAX and a minimal forwarding
trace.

Our own version of the cases of Quax's eager dispatch benchmarks (Quax's
`tests/benchmark/`), with the same types and operations, each library using its
own types (see `_eager_impls.py`); all operands have 16 elements:

- one call, one operation: `MyArray + MyArray` (a user value with an `add`
  rule), nested `quaxify(quaxify(add))` on the same, `Zero + array`, `Unitful *
  Unitful`, the materialising fallback (`jnp.sin` of a `LoraArray` that allows
  materialising), a LoRA `lax.dot_general`, and an inner `jax.jit` called on a
  `MyArray` (Quax's compiled-call cache); plain JAX does the same on the arrays
  (LoRA: the three products by hand);
- the cases this script had before: `x + y` and `x @ w` on dense values (for
  Quax a user value with no rule), a LoRA matvec `w @ x`, the same with
  quaxlike's opt-in `compile_eagerly` (quaxlike only), and `jnp.sum((a - b) **
  2)` on two `Unitful` lengths (quaxlike: km and m, converted by the rule, plain
  divides by 1000; Quax's example has no km: m and m);
- many operations inside one call: `acc = acc + b`, `acc = acc @ w` on dense
  values and LoRA `acc = w @ acc` (plain: the three products by hand), `--ops`
  operations (default 1,000) inside one `quaxify` call; time per operation.

Columns: plain JAX; `forward`, the same plain function under a trace that binds
every primitive again, unchanged, on the trace below (the floor of any trace
that forwards each operation); `forward, compiled`, the same trace running each
`jax.numpy` call through one compiled call, as quaxlike does eagerly (the floor
of such a trace: JAX's Python `jit` path, taken because a trace is current,
plus the compiled call); Quax; quaxlike. The implementations run
interleaved in one process: each repeat times every column of a case back to
back, and the medians are reported.

Timings on a loaded machine are noise; `--instructions` also counts the
instructions each cell executes with Valgrind's callgrind (as
`instructions.py` does) and prints them as ratios to plain JAX.

Run: `python benchmarks/eager_ops.py [--quick] [--repeats N] [--impl quax|quaxlike|both]
[--ops N] [--instructions]`. Quax is not a dependency: install quax 0.4.6 beside
quaxlike (for example in a virtual environment with `--system-site-packages`
and `pip install quax==0.4.6 --no-deps`) to get its column; without it `both`
runs quaxlike alone and says so.
"""

import argparse
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import _eager_impls as impls
import _harness as h
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from quaxlike.lora import LoraArray


class CompiledLoraArray(LoraArray):
    """`LoraArray` with the opt-in to compiled eager calls."""

    compile_eagerly = True


WIDTH = 16
RANK = 4
PLAIN, FORWARD, FORWARD_COMPILED = "plain JAX", "forward", "forward, compiled"
_CHILD_FLAG = h.CALLGRIND_CHILD_FLAG
_callgrind = h.callgrind_control


@dataclasses.dataclass
class Case:
    """One row: a plain function of arrays, and per implementation a
    zero-argument callable doing the same on that implementation's values.

    `ops` is the number of operations one call performs (the loop cases), by
    which times and counts are divided; `target` is the issue's bound on the
    ratio to plain JAX, if it sets one."""

    name: str
    plain: Callable[..., Any]
    args: tuple[Any, ...]
    runs: dict[str, Callable[[], Any]]
    ops: int = 1
    target: float | None = None

    def callables(self) -> dict[str, Callable[[], Any]]:
        fns = {PLAIN: lambda: self.plain(*self.args)}
        forward = impls.forward(self.plain)
        fns[FORWARD] = lambda: forward(*self.args)
        forward_compiled = impls.forward(self.plain, compiled=True)
        fns[FORWARD_COMPILED] = lambda: forward_compiled(*self.args)
        fns.update(self.runs)
        return fns


def _lora_parts(lora: Any) -> tuple[Any, Any, Any]:
    """`(W, A, B)` of either library's `LoraArray`."""
    w = lora.w if hasattr(lora, "w") else lora._w  # Quax's LoraArray keeps `_w`
    return w, lora.a, lora.b


def _loop(step: Callable[[Any, Any], Any], ops: int) -> Callable[[Any, Any], Any]:
    def run(acc, other):
        for _ in range(ops):
            acc = step(acc, other)
        return acc

    return run


def _lora_hand(W, A, B):
    def matvec(x):
        return jax.lax.stop_gradient(W) @ x + A @ (B @ x)

    return matvec


def build_cases(libs: list[impls.Impl], ops: int) -> list[Case]:
    """The rows, in the order printed.

    **Arguments:**

    - `libs`: the implementations to run beside plain JAX and the forwarding trace.
    - `ops`: operations per call in the loop cases.

    **Returns:** the list of `Case`s.
    """
    x = h.array((WIDTH,), seed=1)
    y = h.array((WIDTH,), seed=2)
    q, _ = jnp.linalg.qr(h.array((WIDTH, WIDTH), seed=3))  # orthogonal: `acc @ w` stays finite
    w = q.astype(jnp.float32)
    key = jr.key(4)
    inner = jax.jit(lambda a: a * 2.0 + 1.0)

    def add(a, b):
        return a + b

    def mul(a, b):
        return a * b

    def matmul(a, b):
        return a @ b

    def distance(a, b):
        return jnp.sum((a - b) ** 2)

    dot_dims = (((1,), (0,)), ((), ()))

    # Each library's values, built once; the wrappers too (steady state, not tracing).
    per: dict[str, dict[str, Callable[[], Any]]] = {}
    lora_plain = None
    for lib in libs:
        Q = lib.quaxify
        mx, my = lib.my_array(x), lib.my_array(y)
        dx, dy, dw = lib.dense(x), lib.dense(y), lib.dense(w)
        z = lib.zero((WIDTH,), jnp.float32)
        ux, uy = lib.unitful(x, "m"), lib.unitful(y, "m")
        ua, ub = lib.unitful(x, lib.units[-1]), lib.unitful(y, "m")
        lora = h.random_b(lib.lora(w, RANK, key))
        lora_mat = h.random_b(lib.lora(w, RANK, key, allow_materialise=True))
        if lib.name == "quaxlike":
            lora_plain = _lora_parts(lora)
        add_q, mul_q, mat_q = Q(add), Q(mul), Q(matmul)
        lora_q = Q(lambda m, v: m @ v)
        dist_q = Q(distance)
        runs = {
            "myarray add": (add_q, mx, my),
            "nested add": (Q(Q(add)), mx, my),
            "zero add": (add_q, z, x),
            "unitful mul": (mul_q, ux, uy),
            "fallback sin": (Q(jnp.sin), lora_mat),
            "lora dot_general": (Q(lambda m, r: jax.lax.dot_general(m, r, dot_dims)), lora, w),
            "inner jit": (Q(lambda a: inner(a)), mx),
            "dense add": (add_q, dx, dy),
            "dense matmul": (mat_q, dx, dw),
            "lora matvec": (lora_q, lora, x),
            "units distance": (dist_q, ua, ub),
            "loop add": (Q(_loop(add, ops)), dx, dy),
            "loop matmul": (Q(_loop(matmul, ops)), dx, dw),
            "loop lora": (Q(_loop(lambda acc, m: m @ acc, ops)), x, lora),
        }
        if lib.name == "quaxlike":
            compiled = h.random_b(CompiledLoraArray(w, rank=RANK, key=key))
            runs["lora matvec, compile_eagerly"] = (lora_q, compiled, x)
        per[lib.name] = {
            case: (lambda fn=fn, args=args: fn(*args)) for case, (fn, *args) in runs.items()
        }
    if lora_plain is None:  # quaxlike not run: the plain LoRA from Quax's values
        lora_plain = _lora_parts(h.random_b(libs[0].lora(w, RANK, key)))
    W, A, B = lora_plain
    lora_hand = _lora_hand(W, A, B)
    units_scale = 1000.0 if any(lib.units[-1] == "km" for lib in libs) else 1.0

    rows = [
        ("myarray add", "`MyArray + MyArray`", add, (x, y), None),
        ("nested add", "nested `quaxify(quaxify(add))`, MyArray", add, (x, y), None),
        ("zero add", "`Zero + array`", add, (jnp.zeros_like(x), x), None),
        ("unitful mul", "`Unitful * Unitful`", mul, (x, y), 4.0),
        (
            "fallback sin",
            "materialising fallback `sin(lora)`",
            lambda W, A, B: jnp.sin(W + A @ B),
            (W, A, B),
            None,
        ),
        (
            "lora dot_general",
            "LoRA `dot_general(lora, w)`",
            lambda r: W @ r + A @ (B @ r),
            (w,),
            None,
        ),
        ("inner jit", "inner `jit` (cache hit), MyArray", inner, (x,), None),
        ("dense add", "one call `x + y`, dense", add, (x, y), 2.5),
        ("dense matmul", "one call `x @ w`, dense", matmul, (x, w), None),
        ("lora matvec", "LoRA matvec `w @ x`", lora_hand, (x,), None),
        ("lora matvec, compile_eagerly", "LoRA matvec, compile_eagerly", lora_hand, (x,), None),
        (
            "units distance",
            "`sum((a - b) ** 2)`, Unitful",
            lambda a, b: distance(a, b / units_scale),
            (x, y),
            4.0,
        ),
        ("loop add", f"`acc = acc + b` ×{ops}, per op", _loop(add, ops), (x, y), 4.0),
        ("loop matmul", f"`acc = acc @ w` ×{ops}, per op", _loop(matmul, ops), (x, w), 4.0),
        (
            "loop lora",
            f"LoRA `acc = w @ acc` ×{ops}, per op",
            lambda acc: _loop(lambda a, _: lora_hand(a), ops)(acc, None),
            (x,),
            None,
        ),
    ]
    cases = []
    for key_, title, plain, args, target in rows:
        runs_ = {lib.name: per[lib.name][key_] for lib in libs if key_ in per[lib.name]}
        if runs_:
            n = ops if key_.startswith("loop") else 1
            cases.append(Case(title, plain, args, runs_, n, target))
    return cases


def _result_array(out: Any) -> Any:
    """The array inside a result (a value's `array`, `materialise()` otherwise)."""
    for attr in ("array", "value"):
        if hasattr(out, attr) and not callable(getattr(out, attr)):
            return getattr(out, attr)
    if hasattr(out, "materialise"):
        return out.materialise()
    return out


def _warm(case: Case) -> dict[str, Callable[[], Any]]:
    """The case's callables that run, each called three times (compiling every
    eager operation); a column whose call raises is left out, and reported."""
    working = {}
    for name, fn in case.callables().items():
        try:
            for _ in range(3):
                jax.block_until_ready(_result_array(fn()))
        except Exception as error:  # a library without a rule for this case
            print(f"- {case.name}, {name}: not run ({type(error).__name__}: {str(error)[:120]})")
            continue
        working[name] = fn
    return working


def _time(fns: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each callable, the callables interleaved (the
    order rotating between repeats)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(_result_array(out))
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def _columns(libs: list[impls.Impl]) -> list[str]:
    return [PLAIN, FORWARD, FORWARD_COMPILED, *(lib.name for lib in libs)]


def _verdict(case: Case, cost: dict[str, float], quax_name: str | None) -> str:
    """The issue's targets for this row, met or not, from per-op costs."""
    parts = []
    if "quaxlike" in cost and PLAIN in cost and case.target is not None:
        parts.append(h.at_most(cost["quaxlike"] / cost[PLAIN], case.target, digits=1))
    if quax_name and "quaxlike" in cost and quax_name in cost:
        ok = cost["quaxlike"] <= cost[quax_name]
        parts.append("≤ Quax: " + ("met" if ok else "NOT met"))
    return "; ".join(parts) or "-"


def _table(title: str, cases, costs, libs, unit: Callable[[float], str]) -> None:
    quax_name = next((lib.name for lib in libs if lib.name.startswith("quax ")), None)
    columns = _columns(libs)
    ratio_cols = [c for c in columns if c != PLAIN]
    table = h.Table(
        title,
        ["operation", PLAIN, *(f"{c} (× plain)" for c in ratio_cols), "targets"],
    )
    for case, cost in zip(cases, costs):
        base = cost.get(PLAIN)
        cells = [unit(base) if base else "-"]
        for c in ratio_cols:
            if c in cost and base:
                cells.append(f"{unit(cost[c])} ({cost[c] / base:.1f}×)")
            else:
                cells.append("-")
        table.add(case.name, *cells, _verdict(case, cost, quax_name))
    table.print()


# --- instruction counts (under Valgrind) ---------------------------------------


def _measure(cases: list[Case], samples: int, calls: int) -> None:
    """Inside Valgrind: run each cell between two callgrind dumps, the second
    named `c<case>:<runs>:<column>`: `samples` runs for the loop cases, `samples *
    calls` for the others (one operation is too few instructions to stand out
    from the cost of a dump)."""
    import gc

    prepared = [(i, case, _warm(case)) for i, case in enumerate(cases)]
    gc.collect()
    gc.freeze()
    _callgrind("--instr=on")
    _callgrind("--dump=start")
    for i in range(3):
        _callgrind(f"--dump=empty:{i}")
    for index, case, fns in prepared:
        runs = samples if case.ops > 1 else samples * calls
        for column, fn in fns.items():
            _callgrind("--dump=skip")
            for _ in range(runs):
                out = fn()
            jax.block_until_ready(_result_array(out))
            _callgrind(f"--dump=c{index}:{runs}:{column.replace(' ', '_')}")
    _callgrind("--instr=off")


def _count(argv: list[str]) -> dict[tuple[int, str], float] | None:
    """Instructions per call of every cell, from a child process run under
    callgrind (`None` if Valgrind is missing)."""
    if h.callgrind_missing():
        return None
    totals = h.callgrind_totals(__file__, argv, "quaxlike-eager-callgrind-")
    empty = [n for name, n in totals.items() if name.startswith("empty:")]
    overhead = statistics.median(empty) if empty else 0
    counts = {}
    for name, n in totals.items():
        match = re.fullmatch(r"c(\d+):(\d+):(.+)", name)
        if match:
            index, runs, column = match.groups()
            counts[(int(index), column.replace("_", " "))] = (n - overhead) / int(runs)
    return counts


# --- main ----------------------------------------------------------------------


def _libs(choice: str) -> tuple[list[impls.Impl], str]:
    note = ""
    libs = []
    if choice in ("quax", "both"):
        if impls.quax_available():
            libs.append(impls.quax_impl())
        elif choice == "quax":
            raise SystemExit("--impl quax: Quax is not importable here (pip install quax==0.4.6)")
        else:
            note = "Quax not importable here: quaxlike alone"
    if choice in ("quaxlike", "both"):
        libs.append(impls.quaxlike_impl())
    return libs, note


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    child = _CHILD_FLAG in argv
    if child:
        argv.remove(_CHILD_FLAG)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--impl", choices=("quax", "quaxlike", "both"), default="both")
    parser.add_argument("--ops", type=int, default=None)
    parser.add_argument("--instructions", action="store_true")
    own, rest = parser.parse_known_args(argv)
    args = h.parse_args(__doc__.splitlines()[0], rest, default_repeats=5)
    ops = own.ops or (10 if args.quick else 1000)
    calls = 2 if args.quick else 20
    libs, note = _libs(own.impl)
    cases = build_cases(libs, ops)
    if child:
        _measure(cases, samples=1 if args.quick else 2, calls=calls)
        return

    notes = [
        f"operands f32[{WIDTH}] (w: f32[{WIDTH},{WIDTH}]), LoRA rank {RANK}; "
        f"{calls} calls per sample (loop cases: 1 call of {ops} operations), time per operation",
        f"columns: {', '.join(_columns(libs))}; interleaved in this process",
        *([note] if note else []),
    ]
    h.print_header("eager_ops: eager operations on Values, quaxlike beside Quax", args, notes)
    costs = []
    for case in cases:
        fns = _warm(case)
        if "quaxlike" in fns:
            same = np.allclose(_result_array(fns["quaxlike"]()), fns[PLAIN](), rtol=1e-4, atol=1e-4)
            if not same:
                print(f"- {case.name}: quaxlike's result differs from plain JAX's")
        times = _time(fns, 1 if case.ops > 1 else calls, args.repeats)
        costs.append({name: t / case.ops for name, t in times.items()})
    _table("Eager per-op cost", cases, costs, libs, h.fmt_time)

    if own.instructions:
        child_argv = [a for a in argv if a != "--instructions"]
        counts = _count(child_argv)
        if counts is None:
            print("Instructions not counted: valgrind and callgrind_control not found.\n")
            return
        per_op = [
            {name: n / case.ops for (i, name), n in counts.items() if i == index}
            for index, case in enumerate(cases)
        ]
        _table(
            "Eager instructions per op",
            cases,
            per_op,
            libs,
            lambda n: f"{n / 1e3:.0f} k",
        )


if __name__ == "__main__":
    main()
