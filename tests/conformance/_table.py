"""The conformance table, and the machinery that runs a row.

`CASES` lists every row (see `_inputs.Case`). `SAMPLE` is the deterministic subset
that the costlier tests (one Value position at a time, `DenseArrayValue`, and the
`jit`, `grad` and `vmap` transforms) run by default; `--run-slow` runs every row.

Rows run with `Tracked`, a `PassThrough` (tests/helpers.py) that also records
which primitives reached its `default` with a Value among their operands: the
coverage test uses the record to check that the primitives the table claims to
cover really met a Value.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from _cases_control import CASES as _CONTROL
from _cases_elementwise import CASES as _ELEMENTWISE
from _cases_numerics import CASES as _NUMERICS
from _cases_structure import CASES as _STRUCTURE
from _inputs import Case
from helpers import PassThrough

import quaxlike


CASES: list[Case] = [*_ELEMENTWISE, *_STRUCTURE, *_NUMERICS, *_CONTROL]
CASES_BY_NAME = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "duplicate row names in the conformance table"

# The rows the transform tests (and the per-position and DenseArrayValue runs) cover
# by default: one or two per family of primitives, favouring the ones the core
# treats specially. `--run-slow` runs every row.
SAMPLE = {
    "exp-exp", "int-mul", "bool-and", "complex-mul", "weak-times-strong", "select_n",
    "reduce_max", "cumsum", "dot_general", "conv_general_dilated", "gather",
    "scatter-add", "dynamic_update_slice", "pad-value-operand", "sort", "top_k",
    "cholesky", "fft", "random_bits", "jit", "cond", "while", "scan", "custom_jvp_call",
    "custom_vjp_call", "custom_linear_solve", "remat2", "pure_callback", "mlp", "psum",
}  # fmt: skip
assert SAMPLE <= set(CASES_BY_NAME), SAMPLE - set(CASES_BY_NAME)

# --- the Value type ---------------------------------------------------------------

# Every primitive handed to `Tracked.default` in this session, and the rows whose
# all-Values run has happened; read by the coverage test. (Per-row records would
# be unreliable: the core caches the traced body of a `jit`, so a second row
# calling the same jitted function with Values never reaches `default` again.)
REACHED: set = set()
RAN: set[str] = set()


class Tracked(PassThrough):
    """A `PassThrough` that notes (in `REACHED`) which primitives its `default` handled.

    It also reports a wrapped mutable reference (`jax.new_ref`) as the `AbstractRef`
    it is; `PassThrough.aval` would call it a `ShapedArray`, and JAX would then
    treat `ref[...]` as array indexing.
    """

    def aval(self):
        if isinstance(self.array, jax.Ref):
            return jax.typeof(self.array)
        return super().aval()

    @staticmethod
    def default(primitive, values, params):
        REACHED.add(primitive)
        arrays = [v.array if isinstance(v, PassThrough) else v for v in values]
        out = primitive.bind(*arrays, **params)
        if primitive.multiple_results:
            return [Tracked(o) for o in out]
        return Tracked(out)


def is_value(x) -> bool:
    return isinstance(x, quaxlike.Value)


def wrap(args: tuple, positions, cls=Tracked) -> tuple:
    positions = set(positions)
    return tuple(cls(a) if i in positions else a for i, a in enumerate(args))


def value_leaves(tree) -> list:
    return [x for x in jtu.tree_leaves(tree, is_leaf=is_value) if is_value(x)]


def materialise(tree):
    return jtu.tree_map(
        lambda x: quaxlike.internal.materialise_value(x) if is_value(x) else x,
        tree,
        is_leaf=is_value,
    )


def run_with_values(c: Case):
    """Run row `c` with a `Tracked` Value in every array position."""
    out = c.call(quaxlike.quaxify(c.fn), wrap(c.args, c.array_positions()))
    RAN.add(c.name)
    return out


# --- comparing with plain JAX -------------------------------------------------------


def _describe(x) -> str:
    weak = getattr(x, "weak_type", False)
    return f"{np.dtype(x.dtype) if not _is_key(x) else x.dtype}{list(np.shape(x))}{' weak' if weak else ''}"


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_same(out, expected, *, tol=None, compare="values", where=""):
    """Assert `out` (Values materialised) equals `expected`: the same PyTree, and for
    each array the same shape, dtype, weak type and (unless `compare == "aval"`) the
    same values, to `tol` for inexact dtypes and exactly otherwise."""
    out = materialise(out)
    out_leaves, out_tree = jtu.tree_flatten(out)
    exp_leaves, exp_tree = jtu.tree_flatten(expected)
    assert out_tree == exp_tree, f"{where}: PyTree structure {out_tree} != {exp_tree}"
    tol = {"rtol": 1e-5, "atol": 1e-6} if tol is None else tol
    for i, (a, b) in enumerate(zip(out_leaves, exp_leaves)):
        at = f"{where} output leaf {i}"
        if not (eqx.is_array(b) or eqx.is_array(a)):
            assert a == b, f"{at}: {a!r} != {b!r}"
            continue
        assert np.shape(a) == np.shape(b) and a.dtype == b.dtype, (
            f"{at}: got {_describe(a)}, JAX gives {_describe(b)}"
        )
        assert getattr(a, "weak_type", False) == getattr(b, "weak_type", False), (
            f"{at}: got {_describe(a)}, JAX gives {_describe(b)} (weak type differs)"
        )
        if compare == "aval":
            continue
        if _is_key(b):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        if jnp.issubdtype(b.dtype, jnp.inexact):
            a64 = a.astype(np.complex128 if jnp.iscomplexobj(b) else np.float64)
            b64 = b.astype(a64.dtype)
            assert np.allclose(a64, b64, equal_nan=True, **tol), (
                f"{at}: values differ; max abs difference {np.nanmax(np.abs(a64 - b64))}"
            )
        else:
            assert np.array_equal(a, b), f"{at}: values differ:\n{a}\n!=\n{b}"


# --- transforms ---------------------------------------------------------------------


def split_static(c: Case):
    """`(fn_of_arrays, arrays)`: `c.fn` with its non-array arguments closed over."""
    positions = c.array_positions()
    static = {i: a for i, a in enumerate(c.args) if i not in positions}

    def fn(*arrays):
        it = iter(arrays)
        return c.fn(*(static[i] if i in static else next(it) for i in range(len(c.args))))

    return fn, tuple(c.args[i] for i in positions)


def is_real_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def grad_positions(c: Case) -> list[int]:
    """Positions among the array arguments that `grad` differentiates; empty when
    the row takes no part in the grad test."""
    if not c.grad or c.axis_name is not None:
        return []
    _, arrays = split_static(c)
    positions = [i for i, a in enumerate(arrays) if is_real_float(a) and a.dtype == jnp.float32]
    if not positions:
        return []
    fn, arrays = split_static(c)
    out = jax.eval_shape(fn, *arrays)
    if not any(is_real_float(o) for o in jtu.tree_leaves(out)):
        return []
    return positions


def scalarise(out):
    """A weighted sum of the real floating outputs, so every output matters."""
    total = jnp.float32(0.0)
    for leaf in jtu.tree_leaves(materialise(out)):
        if is_real_float(leaf):
            weights = jnp.cos(jnp.arange(leaf.size, dtype=jnp.float32)).reshape(leaf.shape)
            total = total + jnp.sum(leaf.astype(jnp.float32) * weights)
    return total


def batch(x):
    """Two examples stacked along a new leading axis: for floats the second is
    scaled by 0.75 (which keeps them in every row's domain), for the rest a copy. A
    weakly typed scalar stays weakly typed (a broadcast copy), as a batch of Python
    scalars would be: stacking would make it strong, and then the rows that add it
    to a bfloat16 or complex array would mix dtypes."""
    if getattr(x, "weak_type", False):
        return jnp.broadcast_to(x, (2, *jnp.shape(x)))
    if is_real_float(x) or (hasattr(x, "dtype") and jnp.iscomplexobj(x)):
        return jnp.stack([x, (x * 0.75).astype(x.dtype)])
    return jnp.stack([x, x])
