"""Rows for higher-order primitives (jit, control flow, custom derivatives,
checkpointing, shard_map), callbacks, collectives over a named axis, sharding and
other annotations, mutable references and `jax.export`."""

import functools as ft
import os

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from _inputs import boolean, case, f32, i32, pos, spd
from _known_bugs import (
    DCE_SINK_BATCHING,
)
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import checkify, io_callback
from jax.experimental.buffer_callback import buffer_callback
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.layout import Layout, with_layout_constraint
from jax.experimental.xla_metadata import set_xla_metadata


try:  # removed in jax 0.11
    from jax.experimental.shard_alike import shard_alike
except ImportError:
    shard_alike = None
from jax.sharding import NamedSharding, PartitionSpec


# --- functions with custom derivatives --------------------------------------------


@jax.custom_jvp
def custom_sin(x):
    return jnp.sin(x)


@custom_sin.defjvp
def _custom_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), jnp.cos(x) * t


@jax.custom_jvp
def custom_binary(x, y):
    return x * y + jnp.exp(y)


@custom_binary.defjvp
def _custom_binary_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    return custom_binary(x, y), tx * y + ty * (x + jnp.exp(y))


@jax.custom_vjp
def clipped_identity(x, y):
    return x * y


def _clipped_fwd(x, y):
    return x * y, (x, y)


def _clipped_bwd(res, g):
    x, y = res
    return jnp.clip(g * y, -1.0, 1.0), g * x


clipped_identity.defvjp(_clipped_fwd, _clipped_bwd)


@jax.custom_batching.custom_vmap
def custom_vmapped_sin(x):
    return jnp.sin(x)


@custom_vmapped_sin.def_vmap
def _custom_vmapped_sin_rule(axis_size, in_batched, x):
    return jnp.sin(x), in_batched[0]


def _closed_call(x, y):
    # What evaluating a jaxpr holding a `closed_call` equation does.
    call_jaxpr = jax.make_jaxpr(lambda a, b: jnp.sin(a) * b)(x, y)
    prim = jex_core.primitives.closed_call_p
    params = prim.get_bind_params({"call_jaxpr": call_jaxpr})
    return prim.bind(x, y, **params)


def _call(x):
    call_jaxpr = jax.make_jaxpr(lambda a: (jnp.cos(a) + 1.0,))(x).jaxpr
    prim = jex_core.primitives.call_p
    return prim.bind(x, **prim.get_bind_params({"call_jaxpr": call_jaxpr}))[0]


def _linear_solve(a, b):
    def matvec(x):
        return a @ x

    def solve(matvec, b):
        return jnp.linalg.solve(a, b)

    return lax.custom_linear_solve(matvec, b, solve, symmetric=True)


def _custom_root(c):
    def f(y):
        return y * y - c

    def newton(f, y0):
        return lax.fori_loop(0, 20, lambda _, y: y - f(y) / (2 * y), y0)

    # f is elementwise, so its Jacobian is diagonal: g(ones) is that diagonal.
    return lax.custom_root(f, jnp.ones_like(c), newton, lambda g, y: y / g(jnp.ones_like(y)))


def _while(x, n):
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.9 + 1.0), (0, x))[1]


def _scan(x, w):
    def body(carry, row):
        carry = jnp.tanh(carry @ w + row)
        return carry, carry.sum()

    return lax.scan(body, jnp.zeros(x.shape[1], x.dtype), x)


def _mesh(axis_type=jax.sharding.AxisType.Explicit):
    return jax.make_mesh((1,), ("x",), axis_types=(axis_type,))


def _shard_map(x):
    mesh = _mesh()
    spec = PartitionSpec()
    body = lambda y: jnp.sin(y) * 2.0  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def _shard_map_collectives(x):
    # An `Auto` mesh lets `in_specs` shard an unsharded input.
    mesh = _mesh(jax.sharding.AxisType.Auto)
    spec = PartitionSpec("x")

    def body(y):
        return lax.psum(y, "x") + lax.all_gather(y, "x", tiled=True)

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def _with_ref(x, y):
    ref = jax.new_ref(x)
    ref[...] += y
    ref[0] = y[1]
    jax.ref.addupdate(ref, 1, x[2])
    return jax.ref.freeze(ref)


@jax.jit  # `empty_ref` has no eager implementation
def _with_empty_ref(x):
    ref = jax.empty_ref(jax.typeof(x))
    ref[...] = x * 2.0
    out = ref[...]
    jax.free_ref(ref)
    return out


def _partitioned_sin():
    def partition(mesh, arg_shapes, result_shape):
        return mesh, jnp.sin, result_shape.sharding, (arg_shapes[0].sharding,)

    fn = custom_partitioning(jnp.sin)
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: arg_shapes[0].sharding,
        sharding_rule="i j -> i j",
    )
    return fn


def _buffer_callback(x):
    # The callback writes nothing, so only the output's shape and dtype are compared.
    return buffer_callback(lambda ctx, out, x: None, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _check(x):
    checkify.check(jnp.all(x > -10.0), "x is too small")
    return x * 2.0


_exported_sin = None


def _exported(x):
    global _exported_sin
    if _exported_sin is None:
        _exported_sin = jax.export.export(jax.jit(jnp.sin))(
            jax.ShapeDtypeStruct((3, 4), jnp.float32)
        )
    return _exported_sin.call(x)


def _debug_print(x):
    jax.debug.print("quaxlike conformance: {}", x.sum(), ordered=False)
    return x * 2.0


_seen_by_callback = []


def _debug_callback(x):
    jax.debug.callback(lambda a: _seen_by_callback.append(np.asarray(a).shape), x)
    return x + 1.0


def _pure_callback(x):
    result = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(lambda a: np.sin(a), result, x, vmap_method="sequential")


def _io_callback(x):
    return io_callback(lambda a: np.asarray(a) * 2.0, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


# Checked mode (QUAXLIKE_CHECK=1, read as quaxlike reads it).
_CHECKED = os.environ.get("QUAXLIKE_CHECK", "0") == "1"

CASES = [
    # --- jit and calls ------------------------------------------------------------
    case("jit", jax.jit(lambda x, y: x * y + 1.0), f32(3, 4), f32(3, 4), prims="jit"),
    case("jit-nested", jax.jit(lambda x: jax.jit(jnp.sin)(x) * 2.0), f32(3, 4), prims="jit"),
    case(
        "jit-static-argnum",
        lambda x: jax.jit(jnp.roll, static_argnums=(1,))(x, 2),
        f32(6),
        prims="jit",
    ),
    case("closed_call", _closed_call, f32(3, 4), f32(3, 4), prims=("closed_call", "sin")),
    case("call", _call, f32(3, 4), prims=("call", "cos")),
    case(
        "named_call", lambda x: jax.named_call(jnp.tanh, name="my_tanh")(x), f32(3, 4), prims="tanh"
    ),
    # --- control flow -------------------------------------------------------------
    case(
        "cond",
        lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x),
        jnp.bool_(True),
        f32(3, 4),
        prims="cond",
    ),
    case(
        "cond-false",
        lambda p, x, y: lax.cond(p, lambda: x * y, lambda: x - y),
        jnp.bool_(False),
        f32(3, 4),
        f32(3, 4),
        prims="cond",
    ),
    case(
        "cond-data-predicate",
        lambda x: lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: -v, x),
        f32(3, 4),
        prims="cond",
    ),
    case(
        "switch",
        lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x),
        jnp.int32(2),
        f32(3, 4),
        prims=("clamp", "cond"),
    ),
    case(
        "platform_index",
        lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos),
        f32(3, 4),
        prims=("platform_index", "cond"),
        valueless="platform_index",
    ),
    case(
        "while",
        _while,
        f32(3, 4),
        jnp.int32(3),
        prims="while",
        grad=False,
    ),
    case(
        "fori_loop-traced",
        lambda x, n: lax.fori_loop(0, n, lambda i, c: c * 0.5 + i, x),
        f32(3, 4),
        jnp.int32(3),
        prims="while",
        grad=False,
    ),
    # These scans start from a plain carry that becomes a Value in the body; the
    # core materialises a carry whose type changes, so their outputs are arrays.
    case("scan", _scan, f32(5, 3), f32(3, 3), prims="scan", all_values=False),
    case(
        "scan-reverse-xs",
        lambda xs: lax.scan(lambda c, x: (c + x, c * x), jnp.float32(0.0), xs, reverse=True),
        f32(5),
        prims="scan",
        all_values=False,
    ),
    case(
        "scan-value-carry",
        lambda c, xs: lax.scan(lambda c, x: (c * 0.5 + x, c), c, xs),
        f32(3),
        f32(4, 3),
        prims="scan",
    ),
    case(
        "fori_loop-static",
        lambda x: lax.fori_loop(0, 3, lambda i, c: c * c * 0.5, x),
        f32(3, 4),
        prims="scan",
    ),
    case("map", lambda x: lax.map(jnp.linalg.norm, x), f32(4, 3), prims="scan"),
    case(
        "gcd-while-int",
        jnp.lcm,
        i32(4, low=1, high=12),
        i32(4, low=1, high=12),
        prims="while",
    ),
    # --- custom derivatives -------------------------------------------------------
    case("custom_jvp_call", custom_sin, f32(3, 4), prims="custom_jvp_call"),
    case("custom_jvp_call-binary", custom_binary, f32(3, 4), f32(3, 4), prims="custom_jvp_call"),
    case(
        "custom_jvp_call-constant-arg",
        lambda x: custom_binary(x, jnp.ones_like(x)),
        f32(3, 4),
        prims="custom_jvp_call",
    ),
    case("custom_vjp_call", clipped_identity, f32(3, 4), f32(3, 4), prims="custom_vjp_call"),
    case(
        "custom_root",
        _custom_root,
        pos(4),
        prims=("custom_jvp_call", "scan"),
        tol={"rtol": 1e-4, "atol": 1e-5},
        all_values=False,
    ),
    case(
        "custom_linear_solve",
        _linear_solve,
        spd(3),
        f32(3),
        prims="custom_linear_solve",
        tol={"rtol": 1e-4, "atol": 1e-4},
    ),
    case("custom_vmap_call", custom_vmapped_sin, f32(3, 4), prims="custom_vmap_call", grad=False),
    case(
        "linear_call",
        lambda x: jax.custom_derivatives.linear_call(
            lambda _, t: 2.0 * t, lambda _, t: 2.0 * t, (), x
        ),
        f32(3, 4),
        prims="linear_call",
        vmap=False,
    ),
    case(
        "add_any",
        jax.grad(lambda x: (x * x + jnp.sin(x)).sum()),
        f32(3, 4),
        prims="add_any",
        grad=False,
    ),
    case(
        "grad-inside",
        jax.grad(lambda x, y: jnp.sum(jnp.tanh(x @ y))),
        f32(2, 3),
        f32(3, 2),
        prims=("dot_general", "tanh"),
    ),
    case(
        "jvp-inside",
        lambda x, t: jax.jvp(jnp.sin, (x,), (t,)),
        f32(3, 4),
        f32(3, 4),
        prims=("sin", "cos"),
    ),
    case(
        "vmap-inside",
        jax.vmap(lambda x, y: jnp.dot(x, y)),
        f32(3, 4),
        f32(3, 4),
        prims="dot_general",
    ),
    # --- checkpointing and names --------------------------------------------------
    case("remat2", jax.checkpoint(lambda x: jnp.sin(jnp.sin(x))), f32(3, 4), prims="remat2"),
    case(
        "remat2-policy",
        jax.checkpoint(lambda x, y: jnp.tanh(x @ y), policy=jax.checkpoint_policies.dots_saveable),
        f32(2, 3),
        f32(3, 2),
        prims="remat2",
    ),
    case("name", lambda x: checkpoint_name(jnp.sin(x), "activation"), f32(3, 4), prims="name"),
    # --- callbacks ----------------------------------------------------------------
    case("pure_callback", _pure_callback, f32(3, 4), prims="pure_callback", grad=False),
    case("io_callback", _io_callback, f32(3, 4), prims="io_callback", grad=False),
    case("debug_print", _debug_print, f32(3, 4), prims="debug_print"),
    case("debug_callback", _debug_callback, f32(3, 4), prims="debug_callback"),
    case("check", _check, f32(3, 4), prims="check", jit=False, grad=False, vmap=False),
    # --- annotations, sharding and barriers ---------------------------------------
    case(
        "optimization_barrier",
        lambda x, y: lax.optimization_barrier((x, y)),
        f32(3, 4),
        f32(3, 4),
        prims="optimization_barrier",
    ),
    case(
        "dce_sink",
        lambda x: (lax.dce_sink(x), x * 2.0)[1],
        f32(3, 4),
        prims="dce_sink",
        grad=False,
        # Only checked mode rejects JAX's batching rule; unchecked, it matches.
        xfail={"vmap": DCE_SINK_BATCHING} if _CHECKED else {},
    ),
    case(
        "composite",
        lambda x: lax.composite(lambda y: y * 2.0 + 1.0, name="quaxlike.affine")(x),
        f32(3, 4),
        prims="composite",
        grad=False,
        vmap=False,
    ),
    case(
        "stop_gradient-in-loss",
        lambda x: x * lax.stop_gradient(x),
        f32(3, 4),
        prims="stop_gradient",
    ),
    case(
        "create_token",
        lambda x: (lax.after_all(lax.create_token(), lax.create_token()), x * 2.0)[1],
        f32(3, 4),
        prims=("create_token", "after_all"),
        valueless=("create_token", "after_all"),
    ),
    case(
        "sharding_constraint",
        lambda x: lax.with_sharding_constraint(
            x, NamedSharding(_mesh(jax.sharding.AxisType.Auto), PartitionSpec())
        ),
        f32(3, 4),
        prims="sharding_constraint",
    ),
    case(
        "reshard",
        lambda x: jax.sharding.reshard(x, NamedSharding(_mesh(), PartitionSpec())),
        f32(3, 4),
        prims="reshard",
    ),
    case(
        "device_put",
        lambda x: jax.device_put(x, jax.devices()[0]) * 2.0,
        f32(3, 4),
        prims="device_put",
    ),
    *(
        [case("shard_alike", shard_alike, f32(3, 4), f32(3, 4), prims="shard_alike")]
        if shard_alike is not None
        else []
    ),
    case(
        "layout_constraint",
        lambda x: with_layout_constraint(x, Layout((0, 1))),
        f32(3, 4),
        prims="layout_constraint",
    ),
    case(
        "xla_metadata_value",
        lambda x: set_xla_metadata(x, tag="quaxlike") * 2.0,
        f32(3, 4),
        prims="xla_metadata_value",
    ),
    case(
        "inspect_sharding",
        lambda x: (jax.debug.inspect_array_sharding(x, callback=lambda s: None), x)[1],
        f32(3, 4),
        prims="inspect_sharding",
    ),
    case("shard_map", _shard_map, f32(3, 4), prims="shard_map"),
    case(
        "shard_map-collectives",
        _shard_map_collectives,
        f32(2, 3),
        prims=("shard_map", "psum_invariant", "all_gather", "pvary"),
    ),
    # --- mutable references, export, checkify -------------------------------------
    case(
        "new_ref",
        _with_ref,
        f32(3, 4),
        f32(3, 4),
        prims=("new_ref", "get", "swap", "addupdate", "freeze"),
    ),
    # A plain reference written with a Value holds an array: the result is plain.
    case(
        "empty_ref",
        _with_empty_ref,
        f32(3, 4),
        prims=("jit", "empty_ref", "free_ref"),
        valueless=("empty_ref", "free_ref"),
        all_values=False,
        vmap=False,
    ),
    case("call_exported", _exported, f32(3, 4), prims="call_exported", vmap=False),
    case(
        "custom_partitioning",
        _partitioned_sin(),
        f32(3, 4),
        prims="custom_partitioning",
        grad=False,
        vmap=False,
    ),
    case(
        "buffer_callback",
        _buffer_callback,
        f32(3, 4),
        prims="buffer_callback",
        compare="aval",
        grad=False,
        vmap=False,
    ),
    # `lax.stage` binds through `Trace.stage_value`, never as an equation.
    case("stage", lambda x: lax.stage(x) * 2.0, f32(3, 4), prims="mul"),
    # --- collectives over a named (vmapped) axis ----------------------------------
    case("psum", lambda x: lax.psum(x, "i"), f32(2, 3), prims="psum", axis_name="i"),
    case("pmean", lambda x: lax.pmean(x, "i"), f32(2, 3), prims="psum", axis_name="i"),
    case("pmax", lambda x: lax.pmax(x, "i"), f32(2, 3), prims="pmax", axis_name="i"),
    case("pmin", lambda x: lax.pmin(x, "i"), i32(2, 3), prims="pmin", axis_name="i"),
    case(
        "all_gather", lambda x: lax.all_gather(x, "i"), f32(2, 3), prims="all_gather", axis_name="i"
    ),
    case(
        "all_to_all",
        lambda x: lax.all_to_all(x, "i", 0, 0),
        f32(2, 2, 3),
        prims="all_to_all",
        axis_name="i",
    ),
    case(
        "pswapaxes",
        lambda x: lax.pswapaxes(x, "i", 0),
        f32(2, 2, 3),
        prims="all_to_all",
        axis_name="i",
    ),
    case(
        "ppermute",
        lambda x: lax.ppermute(x, "i", [(0, 1), (1, 0)]),
        f32(2, 3),
        prims="ppermute",
        axis_name="i",
    ),
    case(
        "pshuffle",
        lambda x: lax.pshuffle(x, "i", [1, 0]),
        f32(2, 3),
        prims="ppermute",
        axis_name="i",
    ),
    case(
        "psum_scatter",
        lambda x: lax.psum_scatter(x, "i", tiled=True),
        f32(2, 4),
        prims="reduce_scatter",
        axis_name="i",
    ),
    case(
        "axis_index",
        lambda x: x * lax.axis_index("i"),
        f32(2, 3),
        prims=("axis_index", "mul"),
        valueless="axis_index",
        axis_name="i",
        loose_promotion=True,
    ),
    # --- mixtures that pass Values through several higher-order primitives --------
    case(
        "mlp",
        lambda x, w1, w2: jax.nn.softmax(jax.nn.relu(x @ w1) @ w2),
        f32(2, 4),
        f32(4, 8),
        f32(8, 3),
        prims=("dot_general", "custom_jvp_call"),
    ),
    case(
        "layernorm",
        lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5),
        f32(3, 4),
        prims=("reduce_sum", "sqrt"),
    ),
    case(
        "cond-in-scan",
        lambda xs, p: lax.scan(
            lambda c, x: (lax.cond(p, jnp.add, jnp.subtract, c, x), c),
            jnp.zeros(3, jnp.float32),
            xs,
        ),
        f32(4, 3),
        boolean(),
        prims=("scan", "cond"),
        all_values=False,
    ),
    case(
        "jit-in-checkpoint",
        jax.checkpoint(jax.jit(lambda x: jnp.cos(x) @ x.T)),
        f32(3, 4),
        prims=("remat2", "jit"),
    ),
    case("partial-closure", ft.partial(jnp.add, 1.0), f32(3, 4), prims="add"),
]
