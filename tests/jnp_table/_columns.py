"""The columns of the table: one per example type, with how to build its Values.

A column turns the example array of a slot into a Value of its type (or says
it cannot: a `LoraArray` is a matrix), and says how to turn a Value back into
the dense array it stands for, which is what the plain-JAX side of each
comparison is computed on.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.named import NamedArray
from quaxlike.prng import PRNGKeyValue
from quaxlike.quantized import (
    FakeQuantized,
    Float8Weight,
    quantize_int4,
    quantize_int8,
    quantize_w8a8,
    QuantizedArray,
)
from quaxlike.sparse import BCOO
from quaxlike.structured import TriDiagonal
from quaxlike.symbolic.constant import Constant
from quaxlike.symbolic.zero import Zero
from quaxlike.units import m, Unit, Unitful


@dataclasses.dataclass(frozen=True)
class Column:
    """One example type.

    - `name`: the column's heading.
    - `make`: slot name and example array -> a Value standing for an array of the
        same shape and dtype, or None where the type cannot.
    - `placement`: `"first"` puts a Value in the first slot the type can fill
        (the others stay dense: a Value meeting ordinary arrays, as in a model),
        `"all"` in every such slot (quantities meet quantities).
    - `names`: words of which one must appear in a refusal for it to count as
        naming the type.
    - `by_design`: why refusing to materialise is the point of the type, or None
        when the type materialises freely.
    - `tol`: `(rtol, atol)` for comparing with plain JAX.
    - `atol_of_largest`: whether `atol` is a fraction of the plain result's
        largest magnitude (at least 1) rather than absolute: for a type whose
        products are evaluated in low precision, whose error grows with the
        operands and their sums as a quantised product's does.
    - `rescale`: for a type whose results carry more than numbers (a unit), a
        function giving the same Value in another form (the same quantity in
        another unit); the results of both must agree once in `canonical` form
        (SI), or the cell is wrong even though its numbers matched. Except for
        the functions in `unit_dependent`, whose result depends on the form by
        nature (rounding a length rounds in its unit: 2.5 m and 0.625 (4 m)
        round differently, in astropy too).
    """

    name: str
    make: Callable[[str, np.ndarray], Any]
    placement: str
    names: tuple[str, ...]
    by_design: str | None = None
    tol: tuple[float, float] = (1e-5, 1e-5)
    atol_of_largest: bool = False
    rescale: Callable[[Any], Any] | None = None
    canonical: Callable[[Any], Any] | None = None
    unit_dependent: tuple[Callable, ...] = ()


def _floating(array) -> bool:
    return np.issubdtype(array.dtype, np.floating)


def _zero(slot, array):
    return Zero(array.shape, array.dtype)


def _constant(slot, array):
    value = {np.dtype(bool): True, np.dtype(np.int32): 2}.get(array.dtype, 1.5)
    return Constant(value, array.shape, array.dtype)


def _lora(slot, array):
    if not (_floating(array) and array.ndim == 2):
        return None
    lora = LoraArray(jnp.asarray(array), rank=1, key=jr.key(1))
    # A nonzero B, so that the array is not just W.
    b = np.random.default_rng(2).uniform(-1.0, 1.0, lora.b.shape).astype(np.float32)
    return eqx.tree_at(lambda x: x.b, lora, jnp.asarray(b))


def _int8(slot, array):
    if not (_floating(array) and array.ndim == 2):
        return None
    return quantize_int8(jnp.asarray(array))


def _int4(slot, array):
    if not (_floating(array) and array.ndim == 2 and array.shape[-1] % 2 == 0):
        return None
    return quantize_int4(jnp.asarray(array), group_size=2)


def _w8a8(slot, array):
    if not (_floating(array) and array.ndim == 2):
        return None
    return quantize_w8a8(jnp.asarray(array))


def _float8(slot, array):
    if not (_floating(array) and array.ndim >= 2):
        return None
    return Float8Weight(jnp.asarray(array))


def _fake_quantized(slot, array):
    if not (_floating(array) and array.ndim >= 2):
        return None
    return FakeQuantized(jnp.asarray(array), bits=8)  # a scale per row: any shape


def _sparse(slot, array):
    if array.ndim == 0 or array.dtype == bool:
        return None
    return BCOO.fromdense(jnp.asarray(array))


def _named(slot, array):
    if array.ndim == 0:
        return None
    return NamedArray(jnp.asarray(array), ("a", "b", "c", "d")[: array.ndim])


def _unitful(slot, array):
    if not _floating(array):
        return None
    return Unitful(jnp.asarray(array), m)


_FOUR_METRES = Unit(m=1, scale=4.0)  # a power of two: exact in floating point


def _in_four_metres(x):
    return Unitful(x.array / 4.0, _FOUR_METRES)


def _in_si(tree):
    return jax.tree.map(
        lambda x: x.to(x.unit.si).array if isinstance(x, Unitful) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Unitful),
    )


def _prng(slot, array):
    # Keys stand in for float arrays: most functions are meant to refuse them.
    if not _floating(array) or array.ndim == 0:
        return None
    keys = jr.split(jr.key(3), array.size)
    return PRNGKeyValue(keys.reshape(array.shape))


def _structured(slot, array):
    if not (_floating(array) and array.ndim == 2 and array.shape[0] == array.shape[1]):
        return None
    bands = [np.diagonal(array, k) for k in (-1, 0, 1)]
    return TriDiagonal(*map(jnp.asarray, bands))


_MATERIALISING = (
    "{type} refuses to build its dense array for an operation with no rule: avoiding "
    "that array is what the type is for (`allow_materialise=True` lets it)."
)

COLUMNS = [
    Column("zero", _zero, "first", ("Zero",)),
    Column("constant", _constant, "first", ("Constant",)),
    Column(
        "lora",
        _lora,
        "first",
        ("LoraArray",),
        _MATERIALISING.format(type="LoraArray"),
        (1e-4, 1e-4),
    ),
    Column(
        "int8",
        _int8,
        "first",
        ("Int8Array",),
        _MATERIALISING.format(type="Int8Array"),
        (1e-4, 1e-4),
    ),
    Column(
        "int4",
        _int4,
        "first",
        ("Int4Array",),
        _MATERIALISING.format(type="Int4Array"),
        (1e-4, 1e-4),
    ),
    # Products quantise the other operand too, per token to int8 (half a step of
    # 1/127.5 of each token's largest entry), or both operands to float8 e4m3
    # (within 2**-4 of each entry): compared at the type's precision, the error
    # as a fraction of the result's largest entry.
    Column(
        "w8a8",
        _w8a8,
        "first",
        ("W8A8Array",),
        _MATERIALISING.format(type="W8A8Array"),
        (2e-2, 2e-2),
        atol_of_largest=True,
    ),
    Column(
        "float8",
        _float8,
        "first",
        ("Float8Weight", "Float8"),
        None,
        (0.1, 0.15),
        atol_of_largest=True,
    ),
    # Quantisation-aware training: the array is the weight rounded onto int8's
    # grid (what `to_dense` materialises), every rule exact for it.
    Column("fake-quantized", _fake_quantized, "first", ("FakeQuantized",), None, (1e-5, 1e-5)),
    Column("sparse", _sparse, "first", ("BCOO",), _MATERIALISING.format(type="BCOO"), (1e-4, 1e-4)),
    Column("named", _named, "first", ("NamedArray", "named")),
    Column(
        "unitful",
        _unitful,
        "all",
        ("Unitful", "quantity"),
        rescale=_in_four_metres,
        canonical=_in_si,
        # Rounding, and conversion to integers, happen in the quantity's unit.
        unit_dependent=(
            jnp.floor,
            jnp.ceil,
            jnp.round,
            jnp.around,
            jnp.rint,
            jnp.trunc,
            jnp.modf,
            jnp.astype,
        ),
        tol=(1e-5, 1e-5),
    ),
    Column("prng", _prng, "all", ("PRNGKeyValue", "PRNG key")),
    Column("structured", _structured, "first", ("TriDiagonal",), None, (1e-4, 1e-4)),
]
COLUMNS_BY_NAME = {c.name: c for c in COLUMNS}


def to_dense(x: Any) -> Any:
    """The plain array a Value stands for (the numbers of a quantity, in its unit;
    the typed keys of a PRNG key Value); anything else as it is."""
    if isinstance(x, LoraArray):
        return x.dense()
    if isinstance(x, QuantizedArray):
        return x.dequantize()
    if isinstance(x, BCOO):
        return x.todense()
    if isinstance(x, Unitful):
        return x.array
    if isinstance(x, NamedArray):
        return x.array
    if isinstance(x, quaxlike.Value):
        return quaxlike.internal.materialise_value(x)
    return x


def dense_tree(tree: Any) -> Any:
    return jax.tree.map(to_dense, tree, is_leaf=lambda x: isinstance(x, quaxlike.Value))
