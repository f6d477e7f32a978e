"""One fine-tuning step of Llama-shaped decoders (1B and 8B parameters), compiled
for shapes only: peak memory, arguments and temporaries of full fine-tuning,
LoRA, QLoRA at 4 and 8 bits (and NF4 where available), and trace and compile
time of quaxlike's LoRA against the same LoRA written by hand in plain JAX.

The model is an Equinox decoder: a token embedding; `layers` decoder blocks
stacked (every leaf with a leading layer axis, built with `eqx.filter_vmap`) and
run with `lax.scan` over a `jax.checkpoint`ed block (the backward pass recomputes
each block from its input, the only thing the scan saves per layer; with
`--layers-per-checkpoint k`, the default at 70B, a scan over checkpointed groups
of k layers around it, which saves the input of every k-th layer only and runs
each group forward once more in the backward pass); each block
an RMS norm, grouped-query attention with rotary position embeddings (`heads`
query heads sharing `kv_heads` key/value heads), an RMS norm and a SwiGLU
feed-forward layer; a final RMS norm and an output head. Every projection is an
`eqx.nn.Linear` without bias; weights are bfloat16. Loss: the mean cross-entropy
of the next token over a batch of 1 x `seq` tokens (`jax.vmap`); one
`optax.adam` step (`value_and_grad` of the trainable parameters, the update,
`eqx.apply_updates`), its trainable parameters and optimiser state donated.

Attention, the feed-forward layer and the cross-entropy each run over a chunk
of positions at a time (`--attention-chunk 256`, `--mlp-chunk 512`,
`--loss-chunk 256`), each chunk under `jax.checkpoint`, so that the backward
pass holds one chunk's scores, activations or logits rather than the whole
sequence's. The row "QLoRA 4 bits, unchunked model" is the same step with every
position at once, as the model is usually first written.

The arguments are abstract (`jax.ShapeDtypeStruct`s, from
`eqx.filter_eval_shape`): nothing of the model is ever allocated, the step is
only traced (`jax.jit(...).trace`), lowered and compiled, and
`memory_analysis()` of the compiled step gives its memory.

- full fine-tuning: every leaf trainable (adam state in bfloat16, like them);
- LoRA: `loraify(model, rank=16)`, trainable factors (`partition`), run with
  `quaxlike.quaxify`;
- hand-written LoRA: each `Linear` replaced by a plain-JAX module holding the
  same `W`, `A`, `B` and computing `x @ stop_gradient(W).T + (x @ B.T) @ A.T`,
  as `LoraArray`'s rule does;
- QLoRA: `qlora(model, bits=4, group_size=64, rank=16)` and `bits=8`, and
  `bits="nf4"` (with `double_quant=True` where `qlora` takes it) where
  `quantize` accepts it (otherwise the row says "unavailable").
- DoRA (only with `--only` or a full-size model, not in `--quick`'s default
  rows): `loraify(model, rank=16, dora=True)`, and QDoRA,
  `qlora(model, bits="nf4", double_quant=True, group_size=64, rank=16,
  dora=True)`: `DoraArray`s, whose magnitudes train with the factors. The note
  under the table gives QDoRA's peak, trace and compile time against QLoRA
  NF4's. `--models small` (a 4-layer, d=512 decoder) with `--execute` on CPU
  times the compiled steps of DoRA against LoRA.

Peak is `quaxlike.demo.peak_bytes`: arguments + outputs + temporaries - aliased
(the donated state is aliased to the outputs, so peak is about arguments +
temporaries). Trace time is `jax.jit(step).trace(...)`, compile time `.lower()`
and `.compile()` of the traced step, against the hand-written LoRA: compile
time one sample (compiling the 8B model takes a minute or more), trace time of
LoRA and the hand-written LoRA the median of `--repeats` interleaved samples.
Before any of it, the tiny model checks that quaxlike's LoRA step and the
hand-written one give the same loss and gradients, and the chunked model the
unchunked one's loss.

With `--dump DIR`, XLA dumps the program of the row `--dump-row` (QLoRA 4 bits
by default) to DIR, and the script lists the largest buffers live at its peak
(from XLA's `*live-range.txt`), arguments included.

With `--execute` (for an accelerator with room for the arguments), each compiled
step also runs on random arrays of its arguments' shapes: the median time of
three steps after a warm-up one, and the device allocator's peak bytes in use
(`memory_stats()`), which counts the random arguments as well as the step. Run
one row per process (`--only`) for a row's own peak.

Run: `python benchmarks/scale.py [--quick] [--models 8b 1b] [--dump DIR] [--execute]`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import _fake_devices  # noqa: F401  (before JAX: fake devices for --devices)
import _harness as h
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from _decoder import Decoder, hand_lora, hand_trainable, Shape, SHAPES
from _execute import execute
from _live_buffers import dump_options, print_live_at_peak
from _sharded import make_mesh
from _sharded_tables import print_sharded_tables, sharded_quick_subprocess

import quaxlike
from quaxlike.lora import loraify, partition, qlora
from quaxlike.quantized import quantize


RANK = 16
GROUP = 64
QLORA4_TARGET = 6.5 * 2**30  # bytes: the QLoRA 4-bit step at 8B
TIME_TARGET = 1.10  # trace and compile time, LoRA against the hand-written LoRA
BASELINE = "hand-written LoRA"
LORA = "LoRA (loraify)"
NF4 = "QLoRA NF4"
DORA = "DoRA (loraify dora=True)"
QDORA = "QDoRA NF4"
QDORA_TARGET = 1.05  # QDoRA's peak against QLoRA NF4's, at 8B
# A small decoder for timing compiled steps on CPU (`--models small --execute`).
SMALL = Shape("small", dim=512, layers=4, heads=8, kv_heads=4, hidden=1408, vocab=4096, seq=256)
GIB = 2**30


# --- the variants ----------------------------------------------------------------


def nf4_available() -> bool:
    """Whether `quantize` accepts `bits="nf4"` (added on another branch)."""
    try:
        quantize(eqx.nn.Linear(64, 2, use_bias=False, key=jr.key(0)), bits="nf4", group_size=64)
    except (TypeError, ValueError):
        return False
    return True


def _nf4_options() -> dict[str, Any]:
    """Double quantisation of the scales (the QLoRA paper's NF4), where `qlora`
    takes it."""
    parameters = inspect.signature(qlora).parameters
    return {"double_quant": True} if "double_quant" in parameters else {}


def _full(model, key):
    return eqx.partition(model, eqx.is_inexact_array)


def _quaxlike_loss(trainable, frozen, tokens, targets):
    model = eqx.combine(trainable, frozen)
    return jnp.mean(
        jax.vmap(quaxlike.quaxify(lambda m, t, y: m.loss(t, y)), (None, 0, 0))(
            model, tokens, targets
        )
    )


def _plain_loss(trainable, frozen, tokens, targets):
    model = eqx.combine(trainable, frozen)
    return jnp.mean(jax.vmap(lambda t, y: model.loss(t, y))(tokens, targets))


# name: (build (model, key) -> (trainable, frozen), loss)
VARIANTS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "full fine-tuning": (_full, _plain_loss),
    LORA: (
        lambda m, k: partition(loraify(m, rank=RANK, key=k)),
        _quaxlike_loss,
    ),
    BASELINE: (lambda m, k: hand_trainable(hand_lora(loraify(m, rank=RANK, key=k))), _plain_loss),
    "QLoRA 4 bits": (
        lambda m, k: partition(qlora(m, bits=4, group_size=GROUP, rank=RANK, key=k)),
        _quaxlike_loss,
    ),
    "QLoRA 8 bits": (
        lambda m, k: partition(qlora(m, bits=8, rank=RANK, key=k)),
        _quaxlike_loss,
    ),
    NF4: (
        lambda m, k: partition(
            qlora(m, bits="nf4", group_size=GROUP, rank=RANK, key=k, **_nf4_options())
        ),
        _quaxlike_loss,
    ),
    DORA: (
        lambda m, k: partition(loraify(m, rank=RANK, key=k, dora=True)),
        _quaxlike_loss,
    ),
    QDORA: (
        lambda m, k: partition(
            qlora(m, bits="nf4", group_size=GROUP, rank=RANK, key=k, dora=True, **_nf4_options())
        ),
        _quaxlike_loss,
    ),
}


def abstract_state(shape: Shape, build, optimiser, memory: dict | None = None):
    """`(trainable, opt_state, frozen)` as `jax.ShapeDtypeStruct`s, and the number of
    parameters of the dense model (nothing is allocated)."""

    def make(key):
        model = Decoder(shape, key, **(memory or {}))
        trainable, frozen = build(model, jr.fold_in(key, 1))
        return trainable, optimiser.init(trainable), frozen

    dense = eqx.filter_eval_shape(Decoder, shape, jr.key(0))
    return eqx.filter_eval_shape(make, jr.key(0)), n_params(dense)


def n_params(tree) -> int:
    """The number of parameters in `tree`'s arrays or `jax.ShapeDtypeStruct`s."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(
        math.prod(x.shape) for x in leaves if isinstance(x, jax.ShapeDtypeStruct | jax.Array)
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:,}"


@dataclasses.dataclass
class Result:
    peak: int
    arguments: int
    temporaries: int
    outputs: int
    aliased: int
    trace_s: float
    compile_s: float
    trainable: int
    step_s: float | None = None  # --execute: median seconds per step, run on the device
    device_peak: int | None = None  # --execute: the allocator's peak bytes in use


def tracer(shape: Shape, name: str, optimiser, memory: dict | None = None):
    """`(trace, state)`: `trace()` traces a new `jax.jit` of the step `name` (a new
    function, so that no cache of JAX's answers for it) on the abstract `state`."""
    build, loss = VARIANTS[name]
    state, _ = abstract_state(shape, build, optimiser, memory)
    tokens = jax.ShapeDtypeStruct((1, shape.seq), jnp.int32)

    def trace():
        step = jax.jit(h.training_step(optimiser, loss), donate_argnums=(0, 1))
        return step.trace(*state, tokens, tokens)

    return trace, state


def measure(
    shape: Shape,
    name: str,
    optimiser,
    dump: str | None = None,
    memory: dict | None = None,
    compiler_options: dict | None = None,
    run: bool = False,
) -> Result:
    trace, state = tracer(shape, name, optimiser, memory)
    start = time.perf_counter()
    traced = trace()
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    options = dict(compiler_options or {})
    if dump:
        options.update(dump_options(dump))
    compiled = traced.lower().compile(compiler_options=options or None)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    step_s, device_peak = execute(compiled, state, shape) if run else (None, None)
    return Result(
        peak=h.peak_bytes(compiled),
        arguments=memory.argument_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        trace_s=trace_s,
        compile_s=compile_s,
        trainable=n_params(state[0]),
        step_s=step_s,
        device_peak=device_peak,
    )


# --- main --------------------------------------------------------------------------

# The row measured on the model as first written (every position at once), to show
# what chunking buys.
WHOLE = "QLoRA 4 bits, unchunked model"


# Positions per chunk of attention (queries), feed-forward and cross-entropy,
# unless the command line says otherwise.
DEFAULT_CHUNKS = dict(attention_chunk=256, mlp_chunk=512, loss_chunk=256)


# Layers per saved residual (`Decoder.layers_per_checkpoint`), unless the command
# line says otherwise: at 70B, groups of 10 of the 80 layers (with 8, the least
# peak of k = 4 to 20 measured in benchmarks/README.md, 2026-11-28); every layer
# elsewhere.
DEFAULT_LAYERS_PER_CHECKPOINT = {"70B": 10}


def memory_options(shape: Shape, args=None) -> dict[str, int]:
    """The `Decoder` options that trade compute for memory: `chunks_for`'s chunk
    sizes and `layers_per_checkpoint` (the command line's, or the shape's
    default)."""
    k = getattr(args, "layers_per_checkpoint", None)
    if k is None:
        k = DEFAULT_LAYERS_PER_CHECKPOINT.get(shape.name, 1)
    return {**chunks_for(shape, args), "layers_per_checkpoint": k}


def _memory_title(memory: dict[str, int]) -> str:
    chunks = ", ".join(f"{k.removesuffix('_chunk')} {v}" for k, v in memory.items() if "chunk" in k)
    return f"chunks: {chunks}; residual saved every {memory['layers_per_checkpoint']} layers"


def chunks_for(shape: Shape, args=None) -> dict[str, int]:
    """The chunk sizes for `shape`: the command line's (`args`; without it, the
    defaults), or an eighth, a quarter and an eighth of the tiny model's
    sequence."""
    if shape.name == "tiny":
        return dict(
            attention_chunk=shape.seq // 8, mlp_chunk=shape.seq // 4, loss_chunk=shape.seq // 8
        )
    return {name: getattr(args, name, default) for name, default in DEFAULT_CHUNKS.items()}


def same_results(memory: dict[str, int]) -> bool:
    """Whether, on the tiny model with random factors, quaxlike's LoRA step and the
    hand-written one give the same loss and gradients, and the chunked model the
    loss of the unchunked one."""
    shape = SHAPES["tiny"]
    key = jr.key(3)
    tokens = jr.randint(key, (1, shape.seq), 0, shape.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    model, whole = (
        h.random_b(loraify(Decoder(shape, jr.key(0), **chunks), rank=RANK, key=jr.key(1)))
        for chunks in (memory, {})
    )
    quax = eqx.filter_jit(jax.value_and_grad(_quaxlike_loss))(*partition(model), tokens, targets)
    hand = eqx.filter_jit(jax.value_and_grad(_plain_loss))(
        *hand_trainable(hand_lora(model)), tokens, targets
    )
    whole_loss = eqx.filter_jit(_quaxlike_loss)(*partition(whole), tokens, targets)
    close = lambda a, b: bool(jnp.allclose(a, b, rtol=2e-2, atol=2e-3))  # noqa: E731 (bfloat16)
    grads_q = [x for x in jax.tree_util.tree_leaves(quax[1]) if eqx.is_array(x)]
    grads_h = [x for x in jax.tree_util.tree_leaves(hand[1]) if eqx.is_array(x)]
    return (
        close(quax[0], hand[0])
        and close(quax[0], whole_loss)
        and len(grads_q) == len(grads_h)
        and all(
            close(q.astype(jnp.float32), p.astype(jnp.float32)) for q, p in zip(grads_q, grads_h)
        )
    )


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the smoke test)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved trace timings of LoRA and hand (5)"
    )
    parser.add_argument("--cold", action="store_true", help="ignored")
    parser.add_argument(
        "--models", nargs="+", choices=("70b", "8b", "1b", "small"), default=("8b", "1b")
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        type=int,
        help="also compile the QLoRA steps sharded FSDP-style over N fake CPU devices "
        "(each N given), with --batch sequences",
    )
    parser.add_argument("--batch", nargs="+", type=int, default=[2], help="sequences per step")
    parser.add_argument(
        "--plans",
        nargs="+",
        choices=("fsdp", "xla"),
        default=("fsdp",),
        help="fsdp: each block gathered as stored in the layer loop, activations split by "
        "batch; xla: the same placement, the rest left to XLA's sharding propagation",
    )
    parser.add_argument(
        "--sharded-only",
        action="store_true",
        help="only the --devices tables (no one-device table)",
    )
    parser.add_argument(
        "--sharded-rows",
        nargs="+",
        choices=("QLoRA 4 bits", NF4),
        default=("QLoRA 4 bits", NF4),
        help="the steps compiled over several devices",
    )
    rows = (*VARIANTS, WHOLE)
    parser.add_argument("--only", nargs="+", choices=rows, help="these rows only")
    for name, what in (("attention", "queries"), ("mlp", "positions"), ("loss", "positions")):
        default = DEFAULT_CHUNKS[f"{name}_chunk"]
        parser.add_argument(f"--{name}-chunk", type=int, default=default, help=f"{what} per step")
    parser.add_argument(
        "--layers-per-checkpoint",
        type=int,
        help="layers per residual saved for the backward pass: 1 saves every layer's input; "
        "k > 1 checkpoints groups of k layers around the per-layer checkpoints (default: "
        f"{DEFAULT_LAYERS_PER_CHECKPOINT}, else 1)",
    )
    parser.add_argument(
        "--dump",
        help="a folder for XLA's dump of --dump-row's program (and of each sharded step's, "
        "in a folder of its own)",
    )
    parser.add_argument("--dump-row", default="QLoRA 4 bits", choices=rows)
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the tiny model's check that LoRA and the hand-written LoRA agree",
    )
    parser.add_argument(
        "--execute",
        action="store_true",
        help="also run each compiled step on random arrays (an accelerator's work: the 8B "
        "rows allocate their arguments): step time and the allocator's peak; run one row "
        "per process (--only) for a peak of that row alone",
    )
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    shapes = (
        [SHAPES["tiny"]]
        if args.quick
        else [SMALL if m == "small" else SHAPES[m] for m in args.models]
    )
    nf4 = nf4_available()
    names = [n for n in rows if not args.only or n in args.only]
    if args.quick and not args.only:  # the smoke test: fewer programs to compile
        names = [
            n for n in names if n not in ("full fine-tuning", "QLoRA 8 bits", WHOLE, DORA, QDORA)
        ]
    optimiser = optax.adam(1e-4)
    tiny = chunks_for(SHAPES["tiny"], args)

    h.print_header(
        "scale: one compiled fine-tuning step of Llama-shaped decoders, shapes only",
        args,
        [
            "decoder: embedding, stacked blocks under lax.scan + jax.checkpoint (grouped-query "
            "attention with rotary embeddings, SwiGLU), RMS norms, output head; bfloat16 "
            f"weights; batch 1 x seq; LoRA rank {RANK} on every Linear (head included); "
            f"QLoRA 4 bits with group size {GROUP}; optax.adam, trainable state donated",
            "attention, feed-forward layer and cross-entropy a chunk of positions at a time, "
            "each chunk under jax.checkpoint (chunk sizes in each table's title), except in "
            f"the row '{WHOLE}'",
            "peak = arguments + outputs + temporaries - aliased (memory_analysis()); "
            "compile time: one sample each; trace time of LoRA and the hand-written LoRA: "
            "medians of interleaved samples (--repeats), of the others one sample",
            f"NF4 (quantize(bits='nf4'), qlora options {_nf4_options()}): "
            f"{'available' if nf4 else 'not available in this checkout'}",
            "tiny model, random factors: quaxlike's LoRA step and the hand-written one give the "
            "same loss and gradients, and the chunked model the unchunked one's loss: "
            f"{'not checked (--no-check)' if args.no_check else same_results(tiny)}",
        ],
    )
    if args.quick and not args.devices and not args.only:
        sharded_quick_subprocess()
    for shape in shapes:
        if args.devices:
            sharded_tables(shape, args, optimiser, nf4)
        if args.sharded_only:
            continue
        dense = n_params(eqx.filter_eval_shape(Decoder, shape, jr.key(0)))
        memory = memory_options(shape, args)
        results: dict[str, Result | None] = {}
        for name in names:
            if name in (NF4, QDORA) and not nf4:
                results[name] = None
                continue
            dump = args.dump if name == args.dump_row else None
            variant, options = (name, memory) if name != WHOLE else ("QLoRA 4 bits", None)
            results[name] = measure(shape, variant, optimiser, dump, options, run=args.execute)
            sys.stdout.flush()
        paired = None
        if args.repeats and {LORA, BASELINE} <= set(names):
            # Trace time again, interleaved (as the other scripts time): medians.
            lora_trace, _ = tracer(shape, LORA, optimiser, memory)
            hand_trace, _ = tracer(shape, BASELINE, optimiser, memory)
            paired = h.interleaved(
                lambda: hand_trace, lambda: lora_trace, args.repeats, warmup=0 if args.quick else 1
            )
            results[LORA].trace_s = paired.quax_median
            results[BASELINE].trace_s = paired.plain_median
        table = h.Table(
            f"Fine-tuning step at scale, {shape.name} "
            f"(d={shape.dim}, {shape.layers} layers, {_count(dense)} params, seq {shape.seq}; "
            f"{_memory_title(memory)})",
            [
                "step",
                "trainable",
                "peak",
                "arguments",
                "temporaries",
                "outputs - aliased",
                "trace",
                "trace / hand",
                "compile",
                "compile / hand",
                *(["step (run)", "device peak"] if args.execute else []),
            ],
        )
        base = results.get(BASELINE)
        for name, r in results.items():
            if r is None:
                table.add(name, "unavailable", *["-"] * (len(table.columns) - 2))
                continue
            ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
            table.add(
                name,
                _count(r.trainable),
                h.fmt_bytes(r.peak),
                h.fmt_bytes(r.arguments),
                h.fmt_bytes(r.temporaries),
                h.fmt_bytes(r.outputs - r.aliased),
                h.fmt_time(r.trace_s),
                ratio(r.trace_s, base.trace_s) if base else "-",
                h.fmt_time(r.compile_s),
                ratio(r.compile_s, base.compile_s) if base else "-",
                *(
                    [
                        h.fmt_time(r.step_s) if r.step_s is not None else "-",
                        h.fmt_bytes(r.device_peak) if r.device_peak is not None else "-",
                    ]
                    if args.execute
                    else []
                ),
            )
        notes = []
        q4, lora = results.get("QLoRA 4 bits"), results.get(LORA)
        if q4 is not None and shape.name == "8B":
            notes.append(
                f"QLoRA 4 bits peak {h.fmt_bytes(q4.peak)}: target ≤ {QLORA4_TARGET / GIB:.1f} GiB "
                f"({'ok' if q4.peak <= QLORA4_TARGET else 'over'})"
            )
        notes.extend(dora_notes(results))
        if lora is not None and base is not None:
            worst = max(lora.trace_s / base.trace_s, lora.compile_s / base.compile_s)
            spread = f" (trace paired IQR {paired.spread()})" if paired else ""
            notes.append(
                f"LoRA trace and compile / hand-written: {h.at_most(worst, TIME_TARGET)}{spread}"
            )
        table.print(notes)
        if args.dump:
            print_live_at_peak(f"{args.dump_row} ({shape.name})", args.dump, h.fmt_bytes)


def dora_notes(results: dict[str, Result | None]) -> list[str]:
    """QDoRA's peak, trace and compile time against QLoRA NF4's, and DoRA's
    against LoRA's (step time too, with `--execute`)."""
    notes = []
    pairs = ((QDORA, NF4, QDORA_TARGET), (DORA, LORA, None))
    for dora_name, lora_name, target in pairs:
        dora, lora = results.get(dora_name), results.get(lora_name)
        if dora is None or lora is None:
            continue
        ratio = dora.peak / lora.peak
        verdict = (
            f" (target ≤ {target:.2f}: {'ok' if ratio <= target else 'over'})" if target else ""
        )
        line = (
            f"{dora_name} / {lora_name}: peak {ratio:.3f}{verdict}, trace "
            f"{dora.trace_s / lora.trace_s:.2f}, compile {dora.compile_s / lora.compile_s:.2f}"
        )
        if dora.step_s is not None and lora.step_s:
            line += f", step (run) {dora.step_s / lora.step_s:.2f}"
        notes.append(line)
    return notes


def sharded_tables(shape: Shape, args, optimiser, nf4: bool) -> None:
    """The QLoRA steps of `shape` compiled over each `--devices` count: the rows of
    `--sharded-rows` (NF4's only where it is available), see `_sharded_tables.py`."""
    rows = [name for name in args.sharded_rows if name != NF4 or nf4]

    def state_for(name: str, n: int, plan: str):
        memory = memory_options(shape, args)
        if n > 1 and plan == "fsdp":
            memory["layer_mesh"] = make_mesh(n)
        return abstract_state(shape, VARIANTS[name][0], optimiser, memory)[0]

    title = _memory_title(memory_options(shape, args))
    print_sharded_tables(shape, args, optimiser, rows, state_for, title)


if __name__ == "__main__":
    main()
