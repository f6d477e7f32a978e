"""Which functions the table covers, and the arguments each is called with.

Every public callable of `jax.numpy`, `jax.numpy.linalg` and `jax.nn` is either
called or excluded with a reason (`EXCLUDED`). A function's arguments are
written in terms of *slots*: small example arrays of a few kinds (a 4x4 float
matrix, a boolean mask, int indices, ...) that a column of the table replaces by
Values of its type. Most functions get their arguments from the first of a
short list of candidate signatures that plain JAX accepts (tried abstractly,
with `jax.eval_shape`, so nothing compiles); the rest are written out in
`OVERRIDES`.
"""

import dataclasses
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


# --- slots -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place for an example array of kind `name` (see `SLOT_ARRAYS`)."""

    name: str

    def __repr__(self):
        return self.name


def _make_slot_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20250101)
    square = rng.uniform(-1.0, 1.0, (4, 4)).astype(np.float32)
    return {
        # Square, so that matrix functions and the square-only types apply; a
        # transposition mistake still shows in the values.
        "A": rng.uniform(-2.0, 2.0, (4, 4)).astype(np.float32),
        "B": rng.uniform(-2.0, 2.0, (4, 4)).astype(np.float32),
        "S": square + 4.0 * np.eye(4, dtype=np.float32),  # well conditioned
        "P": (square @ square.T + 4.0 * np.eye(4)).astype(np.float32),  # SPD
        "v": rng.uniform(-2.0, 2.0, (4,)).astype(np.float32),
        "w": rng.uniform(0.5, 2.0, (4,)).astype(np.float32),  # positive
        "x": np.asarray(0.75, np.float32),  # a scalar
        "m": rng.integers(0, 2, (4, 4)).astype(bool),
        "i": rng.integers(0, 4, (4, 4)).astype(np.int32),
        "n": rng.integers(0, 4, (4,)).astype(np.int32),  # indices into 4
    }


SLOT_ARRAYS = _make_slot_arrays()

A, B, S, P = Slot("A"), Slot("B"), Slot("S"), Slot("P")
V, W, X = Slot("v"), Slot("w"), Slot("x")
M, M2, IM, N = Slot("m"), Slot("m2"), Slot("i"), Slot("n")
A1, A3, B3, Q, K = Slot("A1"), Slot("A3"), Slot("B3"), Slot("Q"), Slot("K")
Z = Slot("z")


def _is_slot(x) -> bool:
    return isinstance(x, Slot)


@dataclasses.dataclass(frozen=True)
class Call:
    """Arguments for one call: Python values, with `Slot`s anywhere inside them
    (`jnp.stack([A, B])` has two)."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def slots(self) -> list[Slot]:
        """The slots, in the order `fill` numbers them."""
        leaves = jtu.tree_leaves((self.args, self.kwargs), is_leaf=_is_slot)
        return [leaf for leaf in leaves if _is_slot(leaf)]

    def fill(self, replace: Callable[[int, Slot], Any]) -> tuple[tuple, dict]:
        """The arguments with slot number `i` replaced by `replace(i, slot)`."""
        counter = iter(range(len(self.slots())))
        return jtu.tree_map(
            lambda x: replace(next(counter), x) if _is_slot(x) else x,
            (self.args, self.kwargs),
            is_leaf=_is_slot,
        )

    def __str__(self):
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"({', '.join(parts)})"


def call(*args, **kwargs) -> Call:
    return Call(args, kwargs)


# --- which functions -------------------------------------------------------------

_MODULES = {"jnp": jnp, "jnp.linalg": jnp.linalg, "jax.nn": jax.nn}


def public_functions() -> dict[str, Callable]:
    """`"jnp.sum"` -> the function, for every public callable of the modules."""
    found = {}
    for prefix, module in _MODULES.items():
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or isinstance(obj, (type, types.ModuleType)):
                continue
            if callable(obj):
                found[f"{prefix}.{name}"] = obj
    return found


_SHAPE = "builds an array from a shape, a size or Python values: no array argument"
_TYPES = "answers a question about dtypes or types: no array computation"
_IO = "reads or writes files, buffers or other libraries' arrays: not traceable"
_TEXT = "formats a concrete array as text: not traceable"
_FUNCTIONAL = "takes a Python function; covered by the functions it calls"
_CONFIG = "configuration or planning, computes no array"
_DATA_SHAPE = (
    "the shape of its result depends on the values, so it needs concrete arrays "
    "and has no size argument: it cannot run under a trace, quaxlike's included"
)
_SCALED = "block-scaled products of low-precision formats (mxfp8, nvfp4): out of scope here"

EXCLUDED = {
    **dict.fromkeys(
        [
            "jnp.arange", "jnp.empty", "jnp.eye", "jnp.full", "jnp.identity", "jnp.ones",
            "jnp.zeros", "jnp.linspace", "jnp.logspace", "jnp.geomspace", "jnp.tri",
            "jnp.indices", "jnp.diag_indices", "jnp.tril_indices", "jnp.triu_indices",
            "jnp.mask_indices", "jnp.bartlett", "jnp.blackman", "jnp.hamming",
            "jnp.hanning", "jnp.kaiser", "jnp.array", "jnp.asarray",
        ],
        _SHAPE,
    ),
    **dict.fromkeys(
        [
            "jnp.can_cast", "jnp.isdtype", "jnp.issubdtype", "jnp.promote_types",
            "jnp.result_type", "jnp.iscomplexobj", "jnp.isrealobj", "jnp.isscalar",
            "jnp.iterable", "jnp.broadcast_shapes",
        ],
        _TYPES,
    ),
    **dict.fromkeys(
        [
            "jnp.load", "jnp.save", "jnp.savez", "jnp.fromfile", "jnp.frombuffer",
            "jnp.fromstring", "jnp.fromiter", "jnp.from_dlpack",
        ],
        _IO,
    ),
    **dict.fromkeys(["jnp.array_repr", "jnp.array_str"], _TEXT),
    **dict.fromkeys(
        [
            "jnp.vectorize", "jnp.frompyfunc", "jnp.apply_along_axis",
            "jnp.apply_over_axes", "jnp.piecewise", "jnp.fromfunction",
        ],
        _FUNCTIONAL,
    ),
    **dict.fromkeys(
        [
            "jnp.printoptions", "jnp.get_printoptions", "jnp.set_printoptions",
            "jnp.einsum_path", "jax.nn.get_scaled_dot_general_config",
        ],
        _CONFIG,
    ),
    "jnp.trim_zeros": _DATA_SHAPE,
    "jax.nn.scaled_matmul": _SCALED,
}  # fmt: skip


# --- arguments ---------------------------------------------------------------------

# Tried in order; the first that plain JAX accepts (abstractly) is used.
CANDIDATES = [
    call(A),
    call(A, B),
    call(M, A, B),
    call(A, B, S),
    call(A, 1),
    call(V),
    call(V, W),
    call(IM),
    call(IM, N),
    call(M),
]

# Functions whose arguments the candidates do not find, or find badly.
OVERRIDES: dict[str, Call] = {
    # bounds and weights as slots, so that a type fills them too
    "jnp.clip": call(A, X, W),
    "jnp.average": call(A, axis=0, weights=W),
    "jnp.where": call(M, A, B),
    "jnp.select": call([M, M2], [A, B], X),
    "jnp.choose": call(IM, [A, B, S, P], mode="clip"),
    "jnp.einsum": call("ij,jk->ik", A, B),
    "jnp.tensordot": call(A, B, axes=1),
    "jnp.linalg.tensordot": call(A, B, axes=1),
    "jnp.reshape": call(A, (2, 8)),
    "jnp.resize": call(A, (2, 8)),
    "jnp.broadcast_to": call(V, (3, 4)),
    "jnp.take": call(A, N, axis=0),
    "jnp.take_along_axis": call(A, IM, axis=1),
    "jnp.put": call(A, N, V, inplace=False),
    "jnp.put_along_axis": call(A, IM, B, axis=1, inplace=False),
    "jnp.place": call(A, M, V, inplace=False),
    "jnp.fill_diagonal": call(A, X, inplace=False),
    "jnp.insert": call(A, 1, V, axis=0),
    "jnp.delete": call(A, 1, axis=0),
    "jnp.append": call(A, B, axis=0),
    "jnp.compress": call(np.array([True, False, True, True]), A, axis=0, size=3),
    "jnp.permute_dims": call(A, (1, 0)),
    "jnp.extract": call(M, A, size=4),
    "jnp.nonzero": call(A, size=4),
    "jnp.argwhere": call(A, size=4),
    "jnp.flatnonzero": call(A, size=4),
    "jnp.unique": call(A, size=4),
    "jnp.unique_all": call(A, size=4),
    "jnp.unique_counts": call(A, size=4),
    "jnp.unique_inverse": call(A, size=4),
    "jnp.unique_values": call(A, size=4),
    "jnp.union1d": call(V, W, size=4),
    "jnp.intersect1d": call(V, W, size=4),
    "jnp.setdiff1d": call(V, W, size=4),
    "jnp.setxor1d": call(V, W, size=4),
    "jnp.isin": call(A, V),
    "jnp.bincount": call(N, length=4),
    "jnp.histogram": call(V, bins=3, range=(-2.0, 2.0)),
    "jnp.histogram_bin_edges": call(V, bins=3, range=(-2.0, 2.0)),
    "jnp.histogram2d": call(V, W, bins=3, range=((-2.0, 2.0), (0.0, 2.0))),
    "jnp.histogramdd": call(A, bins=3, range=[(-2.0, 2.0)] * 4),
    "jnp.digitize": call(V, Z),
    "jnp.searchsorted": call(Z, V),
    "jnp.interp": call(V, Z, W),
    "jnp.split": call(A, 2),
    "jnp.array_split": call(A, 2),
    "jnp.hsplit": call(A, 2),
    "jnp.vsplit": call(A, 2),
    "jnp.dsplit": call(Slot("T"), 2),
    "jnp.repeat": call(A, 2, axis=0),
    "jnp.roll": call(A, 1, axis=0),
    "jnp.rot90": call(A),
    "jnp.moveaxis": call(A, 0, 1),
    "jnp.rollaxis": call(A, 1),
    "jnp.swapaxes": call(A, 0, 1),
    "jnp.expand_dims": call(A, 0),
    "jnp.squeeze": call(A1, 0),
    "jnp.pad": call(A, 1),
    "jnp.diag": call(A),
    "jnp.diagonal": call(A),
    "jnp.trace": call(A),
    "jnp.tril": call(A),
    "jnp.triu": call(A),
    "jnp.diag_indices_from": call(A),
    "jnp.tril_indices_from": call(A),
    "jnp.triu_indices_from": call(A),
    "jnp.ravel_multi_index": call((N, N), (4, 4), mode="clip"),
    "jnp.unravel_index": call(N, (2, 2)),
    "jnp.partition": call(A, 1),
    "jnp.argpartition": call(A, 1),
    "jnp.lexsort": call((V, W)),
    "jnp.packbits": call(M),
    "jnp.unpackbits": call(np.array([3, 250], np.uint8)),
    "jnp.ldexp": call(A, IM),
    "jnp.frexp": call(A),
    "jnp.polyval": call(V, A),
    "jnp.polyfit": call(V, W, 2),
    "jnp.polyint": call(V),
    "jnp.polyder": call(V),
    "jnp.roots": call(V, strip_zeros=False),
    "jnp.poly": call(V),
    "jnp.convolve": call(V, W),
    "jnp.correlate": call(V, W),
    "jnp.gradient": call(A),
    "jnp.cov": call(A),
    "jnp.corrcoef": call(A),
    "jnp.quantile": call(A, 0.25),
    "jnp.nanquantile": call(A, 0.25),
    "jnp.percentile": call(A, 25.0),
    "jnp.nanpercentile": call(A, 25.0),
    "jnp.kron": call(A, B),
    "jnp.block": call([[A, B], [S, P]]),
    "jnp.stack": call([A, B]),
    "jnp.vstack": call([A, B]),
    "jnp.hstack": call([A, B]),
    "jnp.dstack": call([A, B]),
    "jnp.column_stack": call([A, B]),
    "jnp.concatenate": call([A, B]),
    "jnp.concat": call([A, B]),
    "jnp.unstack": call(A),
    "jnp.meshgrid": call(V, W),
    "jnp.ix_": call(N, N),
    "jnp.vander": call(V, 3),
    "jnp.full_like": call(A, 1.5),
    "jnp.astype": call(A, jnp.int32),
    "jnp.matrix_transpose": call(A),
    "jnp.linalg.matrix_transpose": call(A),
    "jnp.matvec": call(A, V),
    "jnp.vecmat": call(V, A),
    "jnp.vecdot": call(A, B),
    "jnp.linalg.vecdot": call(A, B),
    "jnp.vdot": call(A, B),
    "jnp.unwrap": call(V),
    "jnp.sort_complex": call(V),
    "jnp.ediff1d": call(V),
    "jnp.i0": call(A),
    "jnp.sinc": call(A),
    # linear algebra: well-conditioned or positive definite where it matters
    "jnp.linalg.cholesky": call(P),
    "jnp.linalg.eigh": call(P),
    "jnp.linalg.eigvalsh": call(P),
    "jnp.linalg.inv": call(S),
    "jnp.linalg.solve": call(S, V),
    "jnp.linalg.lstsq": call(S, V),
    "jnp.linalg.det": call(S),
    "jnp.linalg.slogdet": call(S),
    "jnp.linalg.matrix_power": call(S, 2),
    "jnp.linalg.multi_dot": call([A, B, S]),
    "jnp.linalg.tensorinv": call(S, ind=1),
    "jnp.linalg.tensorsolve": call(S, V),
    "jnp.linalg.cross": call(A3, B3),
    "jnp.cross": call(A3, B3),
    "jnp.linalg.outer": call(V, W),
    "jnp.outer": call(V, W),
    # jax.nn
    "jax.nn.one_hot": call(N, 4),
    "jax.nn.glu": call(A),
    "jax.nn.dot_product_attention": call(
        Q, K, Q
    ),
    "jax.nn.scaled_dot_general": call(A, B, (((1,), (0,)), ((), ()))),
}  # fmt: skip

# Extra slot kinds used by a few overrides.
_rng = np.random.default_rng(7)
SLOT_ARRAYS.update(
    {
        "A1": _rng.uniform(-2.0, 2.0, (1, 4)).astype(np.float32),
        "A3": _rng.uniform(-2.0, 2.0, (4, 3)).astype(np.float32),
        "B3": _rng.uniform(-2.0, 2.0, (4, 3)).astype(np.float32),
        # (batch, length, heads, head dim)
        "Q": _rng.uniform(-1.0, 1.0, (1, 4, 1, 4)).astype(np.float32),
        "K": _rng.uniform(-1.0, 1.0, (1, 4, 1, 4)).astype(np.float32),
        "m2": _rng.integers(0, 2, (4, 4)).astype(bool),
        "T": _rng.uniform(-2.0, 2.0, (2, 2, 4)).astype(np.float32),
        "z": np.array([-1.0, 0.0, 1.0, 1.5], np.float32),  # sorted
    }
)


# --- finding each function's call ----------------------------------------------------


def _accepts(fn: Callable, candidate: Call) -> bool:
    """Whether plain JAX accepts `candidate` for `fn` (traced abstractly)."""
    slots = candidate.slots()
    structs = [
        jax.ShapeDtypeStruct(SLOT_ARRAYS[s.name].shape, SLOT_ARRAYS[s.name].dtype) for s in slots
    ]

    def traced(*arrays):
        args, kwargs = candidate.fill(lambda i, slot: arrays[i])
        return fn(*args, **kwargs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.eval_shape(traced, *structs)
    except Exception:
        return False
    return True


def find_call(name: str, fn: Callable) -> Call | None:
    """The arguments the table calls `fn` with, or None if none is found."""
    candidates = [OVERRIDES[name]] if name in OVERRIDES else CANDIDATES
    for candidate in candidates:
        if _accepts(fn, candidate):
            return candidate
    return None
