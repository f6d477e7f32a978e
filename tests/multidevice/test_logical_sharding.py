"""Values placed, constrained and specified by the `PartitionSpec` of the array
they stand for (`quaxlike.leaf_specs`, `device_put`, `leaf_shardings`,
`with_sharding_constraint`), for every ready type, on 8 devices; results compared
with the same computation on one device. Run through `tests/test_multidevice.py`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest
from helpers import randn, tree_allclose
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quaxlike
from quaxlike.interval import Interval
from quaxlike.lora import LoraArray, LoraConvKernel, multi_loraify
from quaxlike.named import NamedArray
from quaxlike.prng import PRNGKeyValue
from quaxlike.quantized import quantize_int4, quantize_int8, quantize_nf4
from quaxlike.sparse import BCOO
from quaxlike.structured import Diagonal, ScaledIdentity, TriDiagonal
from quaxlike.symbolic.constant import Constant
from quaxlike.symbolic.zero import Zero
from quaxlike.units import meters, Unitful


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: run through tests/test_multidevice.py"
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _lora(w, seed=0, rank=2):
    lora = LoraArray(w, rank=rank, key=jr.key(seed))
    return eqx.tree_at(lambda v: v.b, lora, randn(seed + 1, lora.b.shape))


def _nf4_dq():
    # 256 x 512, groups of 64: second-level blocks of 32 rows (8 blocks of rows).
    return quantize_nf4(randn(2, (256, 512)), group_size=64, double_quant=True)


def _multi():
    linear = eqx.nn.Linear(8, 16, key=jr.key(0))
    bank = multi_loraify(linear, count=8, rank=2, key=jr.key(1))
    return eqx.tree_at(lambda m: m.weight.b, bank, randn(3, bank.weight.b.shape)).weight


def _conv():
    kernel = LoraConvKernel(randn(4, (16, 3, 3, 3)), rank=2, key=jr.key(0))
    return eqx.tree_at(lambda v: v.b, kernel, randn(5, kernel.b.shape))


def _dense(v):
    """The array `v` stands for, built on purpose."""
    if hasattr(v, "dequantize"):
        return v.dequantize()
    if isinstance(v, LoraConvKernel):
        return v.dense()
    if isinstance(v, Unitful):
        return v.array
    if isinstance(v, PRNGKeyValue):
        return jr.key_data(v.key)
    if isinstance(v, Interval):
        return jnp.stack([v.lo, v.hi])
    if isinstance(v, BCOO):
        return v.todense()
    return v.materialise()


def _dense_lora(v):
    w = _dense(v.w) if isinstance(v.w, quaxlike.Value) else v.w
    return w + quaxlike.quaxify(lambda a, b: a @ b)(v.a, v.b)


# (name, build, logical spec): each type with the splits it follows.
CASES = [
    ("lora rows", lambda: _lora(randn(0, (16, 8))), P("x")),
    ("lora columns", lambda: _lora(randn(0, (16, 8))), P(None, "x")),
    ("qlora nf4 double quant rows", lambda: _lora(_nf4_dq()), P("x")),
    ("lora conv out channels", _conv, P("x")),
    ("multi lora adapters", _multi, P("x")),
    ("int8 rows", lambda: quantize_int8(randn(0, (16, 24))), P("x")),
    ("int8 columns", lambda: quantize_int8(randn(0, (16, 24))), P(None, "x")),
    (
        "int4 transposed rows",
        lambda: quantize_int4(randn(0, (16, 128)), group_size=16).swapped(),
        P("x"),
    ),
    ("int4 columns", lambda: quantize_int4(randn(0, (16, 128)), group_size=16), P(None, "x")),
    ("nf4 columns", lambda: quantize_nf4(randn(0, (16, 1024)), group_size=64), P(None, "x")),
    ("nf4 double quant rows", _nf4_dq, P("x")),
    ("unitful", lambda: Unitful(randn(0, (16, 4)), meters), P("x")),
    ("named", lambda: NamedArray(randn(0, (16, 4)), ("batch", "feature")), P("x")),
    ("interval", lambda: Interval(randn(0, (8, 4)), randn(0, (8, 4)) + 1), P("x")),
    ("zero", lambda: Zero((16, 4), jnp.float32), P("x")),
    ("constant", lambda: Constant(jnp.float32(3.0), (16, 4)), P("x")),
    ("diagonal rows", lambda: Diagonal(randn(0, (16,))), P("x")),
    ("scaled identity", lambda: ScaledIdentity(jnp.float32(2.0), 16), P(None, "x")),
    (
        "tridiagonal replicated",
        lambda: TriDiagonal(*map(randn, (0, 1, 2), [(7,), (8,), (7,)])),
        P(),
    ),
    ("sparse replicated", lambda: BCOO.fromdense(jnp.eye(8)), P()),
    ("prng keys", lambda: PRNGKeyValue(jr.split(jr.key(0), 16)), P("x")),
]


def _dense_of(v):
    return _dense_lora(v) if isinstance(v, LoraArray) else _dense(v)


@pytest.mark.parametrize("name, build, spec", CASES, ids=[c[0] for c in CASES])
def test_placed_by_logical_spec(mesh, name, build, spec):
    value = build()
    if name == "multi lora adapters":
        dense = jax.vmap(lambda a, b: _dense_lora(LoraArray.from_factors(value.w, a, b)))(
            value.a, value.b
        )
        dense_of = lambda v: jax.vmap(  # noqa: E731
            lambda a, b: _dense_lora(LoraArray.from_factors(v.w, a, b))
        )(v.a, v.b)
    else:
        dense, dense_of = _dense_of(value), _dense_of
    sharding = NamedSharding(mesh, spec)
    placed = quaxlike.device_put(value, sharding)
    specs = quaxlike.leaf_specs(value, spec, mesh)
    # Each leaf sits where the type declares.
    for leaf, leaf_spec in zip(
        jtu.tree_leaves(placed), jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    ):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, leaf_spec), leaf.ndim)
    # The leaves of one device make the Value of that device's block.
    _check_local_value(value, specs, mesh, spec)
    # Under jit, with in/out shardings from the logical spec: the one-device result.
    shardings = quaxlike.leaf_shardings(value, sharding)
    same = jax.jit(lambda v: v, in_shardings=(shardings,), out_shardings=shardings)(placed)
    assert tree_allclose(dense_of(same), dense)
    out = jax.jit(dense_of)(placed)
    assert tree_allclose(out, dense, rtol=1e-5, atol=1e-5)


def _check_local_value(value, specs, mesh, spec):
    leaves, treedef = jtu.tree_flatten(value)
    if not leaves or isinstance(value, (Constant, ScaledIdentity, Diagonal)):
        # Shape held statically, or (a diagonal matrix) a block that is not of the
        # type: nothing per device to rebuild (`shard_map` materialises these).
        return
    local = []
    for leaf, leaf_spec in zip(leaves, jtu.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        entries = tuple(leaf_spec) + (None,) * (leaf.ndim - len(leaf_spec))
        factors = [1 if e is None else mesh.shape[e] for e in entries]
        local.append(
            jax.ShapeDtypeStruct(tuple(s // f for s, f in zip(leaf.shape, factors)), leaf.dtype)
        )
    local_value = jtu.tree_unflatten(treedef, local)
    shape = value.aval().shape
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    expected = tuple(s // (1 if e is None else mesh.shape[e]) for s, e in zip(shape, entries))
    assert tuple(local_value.aval().shape) == expected


# --- what a type cannot follow ------------------------------------------------------


@pytest.mark.parametrize(
    "build, spec, names",
    [
        # Double quantisation: 2 second-level blocks of columns cannot split 8 ways.
        (
            lambda: quantize_nf4(randn(0, (16, 32768)), double_quant=True),
            P(None, "x"),
            ["NF4Array", "position 1", ".scale"],
        ),
        # 4 groups of inputs cannot split 8 ways.
        (
            lambda: quantize_int4(randn(0, (16, 64)), group_size=16),
            P(None, "x"),
            ["Int4Array", "position 1", ".scale"],
        ),
        (lambda: BCOO.fromdense(jnp.eye(8)), P("x"), ["BCOO", "axis 0"]),
        (
            lambda: TriDiagonal(*map(randn, (0, 1, 2), [(7,), (8,), (7,)])),
            P(None, "x"),
            ["TriDiagonal", "lower"],
        ),
        (
            lambda: _lora(quantize_int4(randn(0, (16, 64)), group_size=16)),
            P(None, "x"),
            ["LoraArray", ".w.scale"],
        ),
    ],
    ids=["nf4 double quant columns", "int4 groups", "sparse", "tridiagonal", "qlora int4"],
)
def test_a_spec_a_type_cannot_follow_is_an_error(mesh, build, spec, names):
    value = build()
    with pytest.raises(quaxlike.LogicalShardingError) as info:
        quaxlike.device_put(value, NamedSharding(mesh, spec))
    for name in names:
        assert name in str(info.value)


def test_undeclared_type_follows_leaves_of_its_shape_or_raises(mesh):
    class Twice(quaxlike.ArrayValue):
        full: jax.Array
        half: jax.Array

        def aval(self):
            return jax.core.ShapedArray(self.full.shape, self.full.dtype)

        def materialise(self):
            return self.full + jnp.tile(self.half, (1, 2))

    value = Twice(randn(0, (16, 8)), randn(1, (16, 4)))
    specs = quaxlike.leaf_specs(value, P("x"), mesh)
    assert (specs.full, specs.half) == (P("x"), P("x"))
    with pytest.raises(quaxlike.LogicalShardingError, match="Twice.*half"):
        quaxlike.leaf_specs(value, P(None, "x"), mesh)


# --- inside quaxify ---------------------------------------------------------------


def test_with_sharding_constraint_inside_quaxify_follows_the_declaration(mesh):
    w = _nf4_dq()
    x = randn(3, (4, 512))
    target = NamedSharding(mesh, P("x"))

    def f(w, x):
        w = jax.lax.with_sharding_constraint(w, target)
        return x @ w.T

    out = jax.jit(quaxlike.quaxify(f))(w, x)
    assert tree_allclose(out, x @ w.dequantize().T, rtol=1e-4, atol=1e-4)
    constrained = jax.jit(quaxlike.quaxify(lambda w: jax.lax.with_sharding_constraint(w, target)))(
        w
    )
    for leaf in (constrained.packed, constrained.absmax, constrained.scale):
        assert leaf.sharding.is_equivalent_to(target, 2)
    # The helper does the same, inside or outside quaxify.
    outside = jax.jit(lambda w: quaxlike.with_sharding_constraint(w, target))(w)
    assert outside.scale.sharding.is_equivalent_to(target, 2)


def test_reshard_inside_quaxify_follows_the_declaration():
    # `Explicit` axes: `jax.sharding.reshard` moves a Value as its type declares,
    # codes and both levels of scales by the same rows, and back.
    explicit = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    w = _nf4_dq()
    rows, whole = NamedSharding(explicit, P("x")), NamedSharding(explicit, P())
    with jax.set_mesh(explicit):  # JAX asks for it, to place `w` (on one device)
        placed = jax.jit(quaxlike.quaxify(lambda w: jax.sharding.reshard(w, rows)))(w)
        back = jax.jit(quaxlike.quaxify(lambda w: jax.sharding.reshard(w, whole)))(placed)
    for leaf in (placed.packed, placed.absmax, placed.scale):
        assert leaf.sharding.is_equivalent_to(rows, 2)
    for leaf in (back.packed, back.absmax, back.scale):
        assert leaf.sharding.is_fully_replicated
    assert tree_allclose(back.dequantize(), w.dequantize())


def test_nf4_reproducer_compiles_without_rematerialisation(mesh, capfd):
    # The reproducer: a 1024 x 32768 NF4 weight with double quantisation on
    # 8 devices, compiled for shapes only. Split leaf by leaf along each leaf's
    # largest axis (codes by columns, absmax and scales by rows), XLA warns
    # "Involuntary full rematerialization"; placed by its logical rows, it does not.
    w = eqx.filter_eval_shape(
        lambda: quantize_nf4(jnp.zeros((1024, 32768), jnp.bfloat16), double_quant=True)
    )
    x = jax.ShapeDtypeStruct((16, 32768), jnp.bfloat16)
    replicated = NamedSharding(mesh, P())

    def largest_axis(leaf):
        spec = [None] * leaf.ndim
        spec[max(range(leaf.ndim), key=lambda i: leaf.shape[i])] = "x"
        return NamedSharding(mesh, P(*spec))

    def compile_with(shardings):
        step = jax.jit(quaxlike.quaxify(lambda w, x: x @ w.T), in_shardings=(shardings, replicated))
        return step.lower(w, x).compile()

    capfd.readouterr()
    compile_with(jtu.tree_map(largest_axis, w))
    assert "Involuntary full rematerialization" in capfd.readouterr().err
    compiled = compile_with(quaxlike.leaf_shardings(w, NamedSharding(mesh, P("x"))))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    # Each device holds an eighth of every leaf.
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jtu.tree_leaves(w))
    assert compiled.memory_analysis().argument_size_in_bytes <= total // 8 + 16 * 32768 * 2


@pytest.mark.parametrize(
    "make",
    [
        _nf4_dq,
        lambda: quantize_int8(randn(6, (256, 512))),
        lambda: quantize_int4(randn(7, (256, 512)), group_size=64),
    ],
    ids=["nf4_double_quant", "int8", "int4"],
)
@pytest.mark.parametrize("spec", [P("x", None), P(None, "x")], ids=["rows", "columns"])
def test_quantised_products_under_explicit_mesh_axes(make, spec):
    # JAX's default mesh axes are `Explicit`: there a program must name every
    # sharding JAX cannot tell, and nothing is resharded implicitly. A product
    # with a quantised weight placed by its logical spec runs there, forward and
    # backward, equal to the dense weight's.
    explicit = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    q = make()
    dense = q.dequantize()
    x = randn(8, (16, 512))
    with jax.set_mesh(explicit):
        placed = quaxlike.device_put(q, NamedSharding(explicit, spec))
        xs = jax.device_put(x, NamedSharding(explicit, P()))

        def loss(x, q):
            return jnp.sum(jnp.tanh(x @ q.T))

        out = jax.jit(quaxlike.quaxify(lambda q, x: x @ q.T))(placed, xs)
        grad = jax.jit(jax.grad(quaxlike.quaxify(loss)))(xs, placed)
    assert jnp.allclose(out, x @ dense.T, atol=1e-3, rtol=1e-4)
    assert jnp.allclose(grad, jax.grad(loss)(x, dense), atol=1e-3, rtol=1e-4)
