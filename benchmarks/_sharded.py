"""The multi-device side of `scale.py` (`--devices N`): the step compiled for
shapes only over a 1-D mesh of N devices (fake CPU devices,
`--xla_force_host_platform_device_count`), the model sharded FSDP-style with
`quaxlike.sharding` (every weight split by its logical rows, each
block's weights gathered as stored inside the layer loop, activations split by
batch), and the bytes each collective of the optimised program moves per step.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.sharding import fsdp, model_shardings


AXIS = "data"


def make_mesh(n: int):
    """A 1-D mesh of the first `n` devices, axis `data`, sharded automatically."""
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def fsdp_rules(mesh) -> list:
    """Every leaf (a Value as one) split along its rows (or columns) over `data`,
    but the token embedding along its features: a lookup in a table split by
    rows would gather the whole table (1 GiB at 70B, in float32 on XLA:CPU).
    `fsdp` keeps the layer axis of the stacked blocks whole, their norm weights
    (a vector per layer, `(layers, dim)`) included, which it splits along their
    features: split along layers, a loop that takes a layer by its index
    (`Decoder(layers_per_checkpoint=k)`) would gather the whole stack for each
    layer (0.8 GiB per step at 70B)."""
    return [("embedding", P(None, AXIS)), ("**", fsdp(mesh, AXIS))]


def _with_shardings(tree, shardings):
    return jtu.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def sharded_state(state, mesh, rules):
    """`(trainable, opt_state, frozen)` of `jax.ShapeDtypeStruct`s, each carrying
    its sharding: the model's by `rules` (every Value by its logical spec), the
    optimiser's moments like the trainable leaves they track, the rest
    replicated."""
    trainable, opt_state, frozen = state
    prefix = model_shardings(eqx.combine(trainable, frozen), mesh, rules)
    trainable_shardings = quaxlike.leaf_shardings(trainable, prefix)
    frozen_shardings = quaxlike.leaf_shardings(frozen, prefix)
    structure = jtu.tree_structure(trainable)
    replicated = NamedSharding(mesh, P())

    def moments(sub):
        if jtu.tree_structure(sub) == structure:
            return _with_shardings(sub, trainable_shardings)
        return jtu.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), sub
        )

    opt = jtu.tree_map(moments, opt_state, is_leaf=lambda x: jtu.tree_structure(x) == structure)
    return (
        _with_shardings(trainable, trainable_shardings),
        opt,
        _with_shardings(frozen, frozen_shardings),
    )


def sharded_loss(model_loss):
    """The mean loss over a batch, each sequence vmapped with the batch axis named
    `data` (so constraints inside split activations by batch)."""

    def loss(trainable, frozen, tokens, targets):
        model = eqx.combine(trainable, frozen)
        per_sequence = jax.vmap(quaxlike.quaxify(model_loss), (None, 0, 0), spmd_axis_name=AXIS)(
            model, tokens, targets
        )
        return jnp.mean(per_sequence)

    return loss


# --- collectives in the optimised program ---------------------------------------------

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "bf16": 2, "f16": 2, "s16": 2,
    "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
_COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass
class Collective:
    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: float  # per execution, per device: the result's bytes
    count: int  # executions per step


def _array_bytes(dtype: str, shape: str) -> float:
    n = 1
    for d in shape.split(","):
        if d:
            n *= int(d)
    return n * _BYTES.get(dtype, 4)


def collectives(hlo: str) -> list[Collective]:
    """Every collective of the optimised HLO text `hlo`, with how many times a
    step runs it (the trip counts of the loops around it, from XLA's
    `known_trip_count`)."""
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    found: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        match = _INSTRUCTION.match(line)
        if current is None or not match:
            continue
        result, opcode, rest = match.groups()
        trip = _TRIP.search(rest)
        for role, callee in _CALLED.findall(rest):
            times = int(trip.group(1)) if opcode == "while" and trip and role == "body" else 1
            calls[current].append((callee, times))
        for branches in _BRANCHES.findall(rest):
            for callee in branches.split(","):
                calls[current].append((callee.strip().lstrip("%"), 1))
        base = opcode.removesuffix("-start")
        if base in _COLLECTIVES and not opcode.endswith("-done"):
            arrays = _ARRAY.findall(result)
            if arrays:
                dtype, shape = arrays[-1]  # an async start's tuple ends with the output
                found[current].append((base, dtype, shape))
    counts: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        counts[name] += times
        if depth < 64:
            for callee, factor in calls.get(name, ()):
                visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1)
    out = []
    for name, ops in found.items():
        for kind, dtype, shape in ops:
            dims = tuple(int(d) for d in shape.split(",") if d)
            out.append(Collective(kind, dtype, dims, _array_bytes(dtype, shape), counts[name]))
    return out


def bytes_per_step(ops: list[Collective]) -> dict[str, float]:
    """Bytes per device per step of each kind of collective, and of all-gathers
    by dtype (`all-gather u8`, ...)."""
    out: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        out[op.kind] += op.bytes * op.count
        if op.kind == "all-gather":
            out[f"all-gather {op.dtype}"] += op.bytes * op.count
    return dict(out)


def dequantised_gathers(ops: list[Collective], weight_shapes: set[tuple[int, int]]) -> list:
    """The floating-point all-gathers whose last two dimensions are a weight's
    `(out, in)` (or its transpose): a dequantised weight crossing devices."""
    bad = []
    for op in ops:
        if op.kind != "all-gather" or op.dtype[0] not in "fb":
            continue
        last = op.shape[-2:]
        if last in weight_shapes or last[::-1] in weight_shapes:
            bad.append(op)
    return bad


@dataclasses.dataclass
class ShardedResult:
    devices: int
    batch: int
    peak: int
    arguments: int
    temporaries: int
    compile_s: float
    collectives: dict[str, float]
    dequantised: int


def measure_sharded(shape, state, loss, optimiser, training_step, devices: int, batch: int,
                    weight_shapes: set[tuple[int, int]], compiler_options: dict | None = None,
                    peak_bytes=None) -> ShardedResult:  # fmt: skip
    """Compile the step on `devices` devices (FSDP) for shapes only and measure it."""
    mesh = make_mesh(devices)
    state = sharded_state(state, mesh, fsdp_rules(mesh))
    split = batch % devices == 0
    tokens = jax.ShapeDtypeStruct(
        (batch, shape.seq), jnp.int32, sharding=NamedSharding(mesh, P(AXIS if split else None))
    )
    step = jax.jit(training_step(optimiser, loss), donate_argnums=(0, 1))
    start = time.perf_counter()
    compiled = step.trace(*state, tokens, tokens).lower().compile(compiler_options)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    ops = collectives(compiled.as_text())
    return ShardedResult(
        devices=devices,
        batch=batch,
        peak=peak_bytes(compiled),
        arguments=memory.argument_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        compile_s=compile_s,
        collectives=bytes_per_step(ops),
        dequantised=len(dequantised_gathers(ops, weight_shapes)),
    )


def weight_shapes(shape) -> set[tuple[int, int]]:
    """The `(out, in)` of every projection of the decoder `shape`."""
    d, kv = shape.dim, shape.kv_heads * shape.head_dim
    return {(d, d), (kv, d), (shape.hidden, d), (d, shape.hidden), (shape.vocab, d)}


def describe(result: ShardedResult) -> dict[str, Any]:
    """Collective bytes as short strings for the table."""
    c = result.collectives
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"  # noqa: E731
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    moved = ", ".join(f"{k} {gib(c[k])}" for k in kinds if c.get(k))
    gathered = ", ".join(
        f"{k.split()[1]} {gib(v)}"
        for k, v in sorted(c.items(), key=lambda kv: -kv[1])
        if k.startswith("all-gather ")
    )
    return {"moved": moved or "none", "gathered": gathered or "none"}
