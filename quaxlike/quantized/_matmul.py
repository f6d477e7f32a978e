"""Matrix products with a quantised operand, dequantised a block of rows at a time.

A `dot_general` with a quantised operand is computed as a loop (`lax.scan`) over
blocks of the weight's stored rows (axis `-2` of `(*batch, out, in)`): each step
dequantises one block (`codes * scale`, exactly what `dequantize()` gives for
those rows) and takes the original product with it. Where the rows are a free
or batch dimension of the product, each block gives those rows of the result,
written in place; where they are contracted, the blocks' products are summed
(and the other operand is sliced to match).

Why a loop, rather than the integer codes multiplied straight away: the dense
weight, or a float copy of its codes, costs as much memory as the float model.
XLA's CPU scheduler starts every dequantisation that does not depend on the
activations as early as it can, so without the loop all of a model's dense
copies are alive at once (`lax.optimization_barrier` does not stop that: XLA
removes it). Inside a loop a block depends on the step's index, so one block is
alive at a time; a loop of one step would be unrolled, hence at least two blocks.
Each step is under `jax.checkpoint`, so `jax.grad` recomputes a block in the
backward loop instead of saving every dequantised block for it.

That loop is the strategy for XLA:CPU only. XLA's GPU compiler fuses an
elementwise dequantisation into the matrix product that consumes it (the dense
weight is never written to memory), where a loop of small products would leave
the device underused; there the rule dequantises the whole weight into one
product ("fused"). Each array's `matmul` field chooses, or with `None` (the
default) `default_matmul` does, for the backend the product is traced for.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike, PyTree

import quaxlike
from quaxlike.internal import bind_dot_general, cached_rule, dot_general_labels, output_aval

from ._base import check_matmul, explicit_sharding, QuantizedArray


# Where a quantised array leaves the strategy to the backend (`matmul=None`): the
# loop where XLA hoists every dequantisation out of it (CPU), and the dequantised
# weight fused into the product elsewhere.
_BACKEND_MATMUL = {"cpu": "loop"}
_OTHER_BACKENDS_MATMUL = "fused"


def default_matmul(platform: str | None = None) -> str:
    """The strategy of matrix products with a quantised array whose `matmul` is
    `None`, for a backend: `"loop"` on CPU, `"fused"` on any other.

    `"loop"` dequantises a block of the weight's rows at a time inside a
    `lax.scan`, so that at most `block_bytes` of dense weight exist at once,
    which XLA:CPU needs (its scheduler starts every dequantisation outside a loop
    as early as it can, keeping all of a model's dense weights alive together).
    `"fused"` dequantises the whole weight into one `dot_general`, which XLA on
    GPU fuses into the product, so the dense weight is never written out.

    **Arguments:**

    - `platform`: a JAX platform name (`"cpu"`, `"gpu"`, `"cuda"`, `"rocm"`,
        `"tpu"`); by default the platform of `jax.default_backend()`, probed when
        the product is traced. A program lowered for another backend than the
        default one should set `matmul` on its arrays (`with_matmul`).

    **Returns:**

    `"loop"` or `"fused"`.

    !!! example

        ```python
        assert default_matmul("cpu") == "loop" and default_matmul("cuda") == "fused"
        ```
    """
    platform = jax.default_backend() if platform is None else platform
    return _BACKEND_MATMUL.get(platform, _OTHER_BACKENDS_MATMUL)


def with_matmul(model: PyTree, matmul: str | None) -> PyTree:
    """`model` with the matrix-product strategy of every quantised array in it set
    to `matmul`, LoRA bases included.

    **Arguments:**

    - `model`: any PyTree holding `QuantizedArray`s.
    - `matmul`: `"loop"`, `"fused"`, or `None` for the backend's default (see
        `default_matmul`).

    **Returns:**

    The same PyTree with the quantised arrays' static `matmul` field replaced.

    !!! example

        ```python
        qmlp = quantize(eqx.nn.MLP(8, 2, 16, depth=1, key=jr.key(0)), bits=4, group_size=8)
        fused = with_matmul(qmlp, "fused")
        assert fused.layers[0].weight.matmul == "fused"
        ```
    """
    check_matmul(matmul, "with_matmul")
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return jax.tree.map(
        lambda x: dataclasses.replace(x, matmul=matmul) if is_quantized(x) else x,
        model,
        is_leaf=is_quantized,
    )


def block_rows(q: QuantizedArray) -> tuple[int, int]:
    """`(blocks, rows)`: how many blocks of how many stored rows a matrix product
    with `q` dequantises, one after another. The blocks cover the rows; when the
    count does not divide them, the last block starts early and overlaps the one
    before it."""
    *batch, rows, columns = q.stored_shape
    if rows <= 1:
        return 1, rows
    row_bytes = math.prod(batch) * columns * np.dtype(q.dtype).itemsize
    blocks = min(rows, max(2, -(-rows * row_bytes // q.block_bytes)))
    size = -(-rows // blocks)
    return -(-rows // size), size


def _product(q_is_lhs: bool, w, other, dimension_numbers, params: dict):
    """The product of a dense `w` with `other`, in the original order."""
    lhs, rhs = (w, other) if q_is_lhs else (other, w)
    if isinstance(other, quaxlike.Value):  # a quantised array, say: redispatch
        return quaxlike.quaxify(bind_dot_general)(lhs, rhs, dimension_numbers, params)
    return bind_dot_general(lhs, rhs, dimension_numbers, params)


def _quantized_dot(q: QuantizedArray, other, dimension_numbers, params: dict, q_is_lhs: bool):
    strategy = q.matmul or default_matmul()
    if strategy == "fused" or _explicitly_sharded(q):
        # Dequantised whole, for a compiler that fuses it into the product. Also
        # where the leaves are sharded along an `Explicit` mesh axis: there each
        # device dequantises its own shard (JAX moves nothing it was not told
        # to), and blocks of rows taken across the shards would need the result
        # resharded, which JAX refuses to do implicitly.
        return _product(q_is_lhs, q.dequantize(), other, dimension_numbers, params)
    return _blocked_dot(q, other, dimension_numbers, params, q_is_lhs)


def _explicitly_sharded(q: QuantizedArray) -> bool:
    """Whether a leaf of `q` is sharded along an `Explicit` mesh axis."""
    return any(explicit_sharding(leaf) is not None for leaf in jax.tree_util.tree_leaves(q))


def _blocked_dot(q: QuantizedArray, other, dimension_numbers, params: dict, q_is_lhs: bool):
    other_ndim = other.ndim if isinstance(other, quaxlike.ArrayValue) else np.ndim(other)
    if q_is_lhs:
        q_labels, other_labels, out_labels = dot_general_labels(
            dimension_numbers, q.ndim, other_ndim
        )
    else:
        other_labels, q_labels, out_labels = dot_general_labels(
            dimension_numbers, other_ndim, q.ndim
        )
    # The stored rows and columns, in the layout the product sees.
    row, column = q_labels[-2:] if not q.transposed else q_labels[:-3:-1]
    other_row = other_labels.index(row) if row in other_labels else None
    out_row = out_labels.index(row) if row in out_labels else None
    other_column = other_labels.index(column) if column in other_labels else None
    out_column = out_labels.index(column) if column in out_labels else None
    # The columns are taken in the phases that unpack fastest (even and odd
    # ones, for 4-bit codes), each with the matching columns of the other
    # operand: the same products, summed in another order.
    phases = q.phases
    if isinstance(other, quaxlike.Value) and other_column is not None:
        phases = 1  # slicing a Value could cost more than it saves
    params = {**params, "out_sharding": None}
    n_rows = q.stored_shape[-2]
    blocks, size = block_rows(q)
    indices = jnp.arange(blocks)

    def product(w, other):
        return _product(q_is_lhs, w, other, dimension_numbers, params)

    def block_product(i, q, other):
        # Strided slices of the other operand, taken here rather than once before
        # the loop: then `jax.grad` saves the operand itself for the backward loop,
        # not a copy of it in pieces.
        others = [other]
        if phases > 1 and other_column is not None:
            others = [_strided(other, j, phases, other_column) for j in range(phases)]
        start = jnp.minimum(i * size, n_rows - size)
        rows = q.stored_rows(start, size)
        ws = rows.dequantize_phases(*rows.row_leaves()) if phases > 1 else [rows.dequantize()]
        if out_row is None and blocks * size != n_rows:
            # The last block overlaps the one before: count its rows once.
            fresh = (start + jnp.arange(size) >= i * size)[:, None]
            ws = [jnp.where(fresh, w, jnp.zeros((), w.dtype)) for w in ws]
        if q.transposed:
            ws = [jnp.swapaxes(w, -1, -2) for w in ws]
        if other_row is not None:
            others = [_slice_rows(o, start, size, other_row) for o in others]
        ys = [product(w, others[j % len(others)]) for j, w in enumerate(ws)]
        if out_column is None:
            ys = [sum(ys[1:], ys[0])]  # the phases' columns were contracted
        return ys, start

    if blocks == 1:  # a single stored row
        outs, _ = block_product(0, q, other)
    elif out_row is not None and blocks * size == n_rows:
        # Each block gives its own rows of the result: stack them (no loop state).
        # `jax.grad` recomputes each block in the backward loop, rather than
        # saving every dequantised block for it.
        block_product = jax.checkpoint(block_product, prevent_cse=False)
        _, outs = lax.scan(lambda _, i: (None, block_product(i, q, other)[0]), None, indices)
        outs = [_merge_blocks(out, out_row) for out in outs]
    else:
        # The rows are contracted (sum the blocks), or the last block overlaps
        # the one before (write each block into place).
        block_product = jax.checkpoint(block_product, prevent_cse=False)
        aval = output_aval(
            lax.dot_general_p,
            (q, other) if q_is_lhs else (other, q),
            {"dimension_numbers": dimension_numbers, **params},
        )
        shape = list(aval.shape)
        if out_column is not None:
            shape[out_column] //= phases
        init = [jnp.zeros(shape, aval.dtype)] * (phases if out_column is not None else 1)

        def step(outs, i):
            ys, start = block_product(i, q, other)
            if out_row is None:
                return [out + y for out, y in zip(outs, ys)], None
            return [
                lax.dynamic_update_slice_in_dim(out, y, start, out_row) for out, y in zip(outs, ys)
            ], None

        outs, _ = lax.scan(step, init, indices)
    if out_column is None or len(outs) == 1:
        return outs[0]
    # Interleave the phases' columns back into order.
    stacked = jnp.stack(outs, axis=out_column + 1)
    shape = list(jnp.shape(outs[0]))
    shape[out_column] *= len(outs)
    return jnp.reshape(stacked, shape)


def _merge_blocks(x, axis: int):
    """`(blocks, ..., size, ...)`, `size` at `axis + 1`, to `(..., blocks * size, ...)`."""
    x = jnp.moveaxis(x, 0, axis)
    shape = list(jnp.shape(x))
    return jnp.reshape(x, (*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :]))


def _strided(x, start: int, step: int, axis: int):
    return lax.slice_in_dim(x, start, None, step, axis)


def _slice_rows(other, start, size: int, axis: int):
    if isinstance(other, quaxlike.Value):
        return quaxlike.quaxify(lax.dynamic_slice_in_dim)(other, start, size, axis)
    return lax.dynamic_slice_in_dim(other, start, size, axis)


@quaxlike.register(lax.dot_general_p)
@cached_rule
def dot_general_p_quantized_dense(x: QuantizedArray, y: ArrayLike, *, dimension_numbers, **params):
    return _quantized_dot(x, y, dimension_numbers, params, q_is_lhs=True)


@quaxlike.register(lax.dot_general_p)
@cached_rule
def dot_general_p_dense_quantized(x: ArrayLike, y: QuantizedArray, *, dimension_numbers, **params):
    return _quantized_dot(y, x, dimension_numbers, params, q_is_lhs=False)


@quaxlike.register(lax.dot_general_p)
@cached_rule
def dot_general_p_quantized_quantized(
    x: QuantizedArray, y: QuantizedArray, *, dimension_numbers, **params
):
    # Blocks of `x` meet `y`, still quantised, in products that `y`'s rule handles
    # (blocks of `y` inside each step): one block of each is alive at a time.
    return _quantized_dot(x, y, dimension_numbers, params, q_is_lhs=True)
