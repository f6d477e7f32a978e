"""Shared pieces of the benchmark scripts: argument parsing, the machine header,
interleaved timing with fresh closures, equation counting and markdown tables.

Every script measures plain JAX and quaxlike side by side in one process: each
repeat times one plain sample and one quaxlike sample back to back (the order
alternating between repeats), so that noise from other work on the machine hits
both sides alike. Reported numbers are medians; the ratio is
`median(quaxlike) / median(plain)`, and the spread column gives the 25th-75th
percentiles of the per-repeat (paired) ratios, as a measure of the noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import gc
import glob
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

# A compiled program's peak memory, defined once in the package (for the demo).
from quaxlike.demo import peak_bytes as peak_bytes


# --- command line ------------------------------------------------------------


def parse_args(
    description: str, argv: Sequence[str] | None = None, *, default_repeats: int = 15
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few repeats and small sizes: checks that the script runs, measures nothing useful",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per measurement (after warm-up)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also call jax.clear_caches() before every timed sample (outside the timing), so "
        "that no tracing cache of JAX's (jnp functions' internal jits included) is warm",
    )
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = (3 if args.quick else default_repeats) if default_repeats else 0
    return args


# --- the machine -------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 0


def machine_header() -> str:
    import jaxlib

    import quaxlike

    versions = (
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, equinox {eqx.__version__}, "
        f"quaxlike {quaxlike.__version__}, Python {platform.python_version()}"
    )
    devices = ", ".join(sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()}))
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return "\n".join(
        [
            f"- date: {now}",
            f"- CPU: {_cpu_model()}, {_usable_cores()} usable cores "
            f"({os.cpu_count()} in the machine), {platform.system()} {platform.release()}",
            f"- JAX devices: {devices}",
            f"- {versions}",
        ]
    )


def print_header(title: str, args: argparse.Namespace, notes: Sequence[str] = ()) -> None:
    print(f"## {title}")
    print()
    print(machine_header())
    mode = (
        "quick (smoke test: sizes and repeats too small to mean anything)" if args.quick else "full"
    )
    repeats = f"; {args.repeats} timed repeats per cell after warm-up" if args.repeats else ""
    print(
        f"- mode: {mode}{repeats}"
        + ("; JAX caches cleared before every sample" if args.cold else "")
    )
    for note in notes:
        print(f"- {note}")
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("QUAXLIKE_")]
    if jax.config.jax_check_tracer_leaks:
        settings.append("jax_check_tracer_leaks=True")
    if settings:
        print(f"- WARNING, not the default configuration: {', '.join(settings)}")
    print()
    sys.stdout.flush()


# --- timing ------------------------------------------------------------------


@dataclasses.dataclass
class Paired:
    """Samples (seconds) of plain JAX and quaxlike, taken in pairs."""

    plain: list[float]
    quax: list[float]

    @property
    def plain_median(self) -> float:
        return statistics.median(self.plain)

    @property
    def quax_median(self) -> float:
        return statistics.median(self.quax)

    @property
    def ratio(self) -> float:
        return self.quax_median / self.plain_median

    @property
    def paired_ratios(self) -> list[float]:
        return [q / p for p, q in zip(self.plain, self.quax)]

    def cells(self, per: float = 1.0) -> list[str]:
        """The table cells every script reports: the two medians (divided by
        `per`, for a sample that timed `per` calls), their ratio, the spread."""
        return [
            fmt_time(self.plain_median / per),
            fmt_time(self.quax_median / per),
            f"{self.ratio:.2f}",
            self.spread(),
        ]

    def spread(self) -> str:
        """The 25th-75th percentiles of the per-repeat ratios."""
        ratios = sorted(self.paired_ratios)
        if len(ratios) < 2:
            return "-"
        lo, hi = _quantile(ratios, 0.25), _quantile(ratios, 0.75)
        return f"{lo:.2f}-{hi:.2f}"


def _quantile(sorted_values: list[float], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    below = int(position)
    above = min(below + 1, len(sorted_values) - 1)
    weight = position - below
    return sorted_values[below] * (1 - weight) + sorted_values[above] * weight


def time_once(fn: Callable[[], Any], *, cold: bool = False) -> float:
    """Seconds taken by one call of `fn`, whose result is blocked on."""
    if cold:
        jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(_arrays_only(out))
    return time.perf_counter() - start


def _arrays_only(tree: Any) -> Any:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def interleaved(
    make_plain: Callable[[], Callable[[], Any]],
    make_quax: Callable[[], Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    cold: bool = False,
) -> Paired:
    """Time plain JAX against quaxlike, alternating between them.

    `make_plain()` and `make_quax()` are called before every sample (outside the
    timing) and return the zero-argument callable to time. Building a new callable
    each time (a new function object, a new `quaxify` wrapper) keeps JAX's tracing
    caches, which are keyed on the function, from hiding the cost being measured.
    The first `warmup` pairs are not recorded. Within each pair the order
    alternates, so neither side always runs on a cache or CPU state the other left.
    """
    plain: list[float] = []
    quax: list[float] = []
    # Objects alive now (JAX's own, the models) are moved out of the collector's
    # sight, so the collection before each sample costs little.
    gc.collect()
    gc.freeze()
    for i in range(warmup + repeats):
        first_plain = i % 2 == 0
        order = [("plain", make_plain), ("quax", make_quax)]
        if not first_plain:
            order.reverse()
        times = {}
        for name, make in order:
            fn = make()
            times[name] = time_once(fn, cold=cold)
            del fn
        if i >= warmup:
            plain.append(times["plain"])
            quax.append(times["quax"])
    gc.unfreeze()
    return Paired(plain, quax)


def per_call(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
    """A callable running `fn` `calls` times (for timing cheap eager calls in a
    batch; divide the measured time by `calls`)."""

    def run():
        out = None
        for _ in range(calls):
            out = fn()
        return out

    return run


# --- models ------------------------------------------------------------------


class Stack(eqx.Module):
    """`depth` square `eqx.nn.Linear` layers, each followed by a relu."""

    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def make_stack(depth: int, width: int, key=None) -> Stack:
    key = jr.key(0) if key is None else key
    return Stack([eqx.nn.Linear(width, width, key=k) for k in jr.split(key, depth)])


def dense_values(model: Any) -> Any:
    """`model` with every array leaf (weights and biases) wrapped in a
    `quaxlike.DenseArrayValue`, so that `quaxify` lifts them all and every
    operation on them goes through the interpreter's dispatch."""
    import quaxlike

    return jax.tree_util.tree_map(
        lambda x: quaxlike.DenseArrayValue(x) if eqx.is_array(x) else x, model
    )


def lora_layers(model: Stack) -> list[tuple[Any, Any, Any, Any]]:
    """`(W, A, B, bias)` for each layer of a loraified `Stack`."""
    return [(layer.weight.w, layer.weight.a, layer.weight.b, layer.bias) for layer in model.layers]


def random_b(model: Any, seed: int = 7) -> Any:
    """`model` with the `B` factor of every `LoraArray` drawn at random (it starts at
    zero, which would hide the low-rank branch from an output check)."""
    from quaxlike.lora import LoraArray

    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_lora)
    keys = iter(jr.split(jr.key(seed), len(leaves)))
    leaves = [
        x.with_factors(x.w, x.a, 0.1 * jr.normal(next(keys), x.b.shape, x.b.dtype))
        if is_lora(x)
        else x
        for x in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def hand_lora_stack(params: list[tuple[Any, Any, Any, Any]], x):
    """What `quaxify(loraified_stack)(x)` computes, written in plain JAX with the
    same operations in the same order: for `y = W x + bias` with `W` a frozen
    `LoraArray`, `stop_gradient(W) @ x + A @ (B @ x) + bias`."""
    for w, a, b, bias in params:
        y = jax.lax.stop_gradient(w) @ x + a @ (b @ x)
        x = jax.nn.relu(y + bias)
    return x


# --- training steps ------------------------------------------------------------


def mse(out, ys):
    return jnp.mean((out - ys) ** 2)


def training_step(optimiser, loss: Callable[..., Any]) -> Callable[..., Any]:
    """`step(trainable, opt_state, *rest) -> (trainable, opt_state, loss value)`:
    one optimiser step on `loss(trainable, *rest)`."""

    def step(trainable, opt_state, *rest):
        value, grads = jax.value_and_grad(loss)(trainable, *rest)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value

    return step


def quaxlike_loss(trainable, frozen, xs, ys):
    """The mean squared error of `quaxify(model)` over a batch, where `model` is
    `trainable` and `frozen` combined (as `partition` split it)."""
    import quaxlike

    model = eqx.combine(trainable, frozen)
    return mse(jax.vmap(quaxlike.quaxify(model))(xs), ys)


def dense_loss(model, xs, ys):
    """The mean squared error of a plain model over a batch (full fine-tuning)."""
    return mse(jax.vmap(model)(xs), ys)


def n_params(tree) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x))


# --- programs ----------------------------------------------------------------


def count_eqns(jaxpr: Any) -> int:
    """Number of equations in a (Closed)Jaxpr, counting into every sub-jaxpr held
    in an equation's parameters (jit bodies, custom_jvp bodies, loop bodies...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            total += _count_param(param)
    return total


def _count_param(param: Any) -> int:
    from jax.extend.core import ClosedJaxpr, Jaxpr

    if isinstance(param, (ClosedJaxpr, Jaxpr)):
        return count_eqns(param)
    if isinstance(param, (list, tuple)):
        return sum(_count_param(p) for p in param)
    return 0


_METADATA = re.compile(r',? ?metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_SIGNATURE = re.compile(r"^((?:ENTRY )?%\S+) \(.*\) -> ")
_NAME = re.compile(r"%[\w.\-]+")


def normalised_hlo(text: str) -> list[str]:
    """The lines of an HLO module's text without what differs between two programs
    that compute the same thing the same way: the module name, source locations
    (the FileNames/.../StackFrames tables and every `metadata={...}`), parameter
    names in computation signatures, and instruction and computation names
    (renamed in order of first appearance)."""
    lines = []
    in_tables = False
    for line in text.splitlines():
        if line.startswith("HloModule "):
            line = "HloModule m," + line.split(",", 1)[1] if "," in line else "HloModule m"
            in_tables = True
            lines.append(line)
            continue
        if in_tables:
            if line.startswith("%") or line.startswith("ENTRY "):
                in_tables = False
            else:
                continue
        line = _METADATA.sub("", line)
        line = _SIGNATURE.sub(r"\1 -> ", line)
        if line.strip():
            lines.append(line.rstrip())
    names: dict[str, str] = {}

    def rename(match):
        return names.setdefault(match.group(0), f"%n{len(names)}")

    return [_NAME.sub(rename, line) for line in lines]


def compare_hlo(text_a: str, text_b: str, context: int = 6) -> tuple[bool, str]:
    """Whether two compiled programs' texts are the same after `normalised_hlo`,
    and a short summary (a few diff lines when they differ)."""
    a, b = normalised_hlo(text_a), normalised_hlo(text_b)
    if a == b:
        return True, f"identical ({len(a)} lines after normalising)"
    diff = [
        d
        for d in difflib.unified_diff(a, b, "plain", "quaxlike", n=0, lineterm="")
        if not d.startswith("@@")
    ]
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    shown = "\n".join("    " + d[:200] for d in diff[: 2 + 2 * context])
    return False, (
        f"different: {removed} lines only in plain, {added} only in quaxlike "
        f"(of {len(a)} / {len(b)}); first differences:\n{shown}"
    )


def array(shape, seed: int = 1, dtype=jnp.float32):
    return jr.normal(jr.key(seed), shape, dtype)


# --- output ------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def at_most(ratio: float, target: float, digits: int = 2) -> str:
    """The target cell: `≤ target (ok)` or `≤ target (over)`."""
    return f"≤ {target:.{digits}f} ({'ok' if ratio <= target else 'over'})"


class Table:
    """A markdown table, printed with a `###` title line above it."""

    def __init__(self, title: str, columns: Sequence[str]):
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [
            max(len(self.columns[i]), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
            for i, c in enumerate(self.columns)
        ]
        line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([f"### {self.title}", "", line(self.columns), rule, *map(line, self.rows)])

    def print(self, notes: Sequence[str] = ()) -> None:
        print(self.render())
        if notes:
            print()
            for note in notes:
                print(note)
        print()
        sys.stdout.flush()


# --- counting instructions under Valgrind ---------------------------------------
# A script measures itself in a child process run under callgrind with
# instrumentation off; the child switches it on around each cell and names a dump
# after it (`callgrind_control --dump=NAME`); the parent reads each dump's total.

CALLGRIND_CHILD_FLAG = "--measure-under-valgrind"


def callgrind_missing() -> list[str]:
    """The Valgrind tools that are not installed (empty when counting can run)."""
    return [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]


def callgrind_control(*command: str) -> None:
    """Send `command` (`--instr=on`, `--dump=NAME`, ...) to the callgrind running
    this process."""
    subprocess.run(
        ["callgrind_control", *command, str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )


def callgrind_totals(script: str, argv: list[str], prefix: str) -> dict[str, int]:
    """Run `script` with `CALLGRIND_CHILD_FLAG` and `argv` under callgrind and read
    the instructions of each named dump.

    **Arguments:**

    - `script`: the benchmark file, which measures itself when given the flag.
    - `argv`: its other arguments.
    - `prefix`: a name for the temporary folder of dumps.

    **Returns:**

    `{dump name: instructions}` for every dump the child named.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={os.path.join(directory, 'cg.out')}",
            sys.executable,
            os.path.abspath(script),
            CALLGRIND_CHILD_FLAG,
            *argv,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stdout[-3000:] + result.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the measuring process failed (exit {result.returncode})")
        totals: dict[str, int] = {}
        for path in glob.glob(os.path.join(directory, "cg.out.*")):
            with open(path) as f:
                text = f.read()  # "desc:" lines at the top, "totals:" at the end
            trigger = re.search(r"^desc: Trigger: dump (\S+)", text, re.MULTILINE)
            total = re.search(r"^totals: (\d+)", text, re.MULTILINE)
            if trigger and total:
                totals[trigger.group(1)] = int(total.group(1))
    return totals
