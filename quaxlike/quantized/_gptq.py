"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", 2022), in JAX, onto the grids of the
existing quantised types.

For a weight `W` `(out, in)` and the Gram matrix `H = sum x xᵀ` of its
calibration inputs, the columns are rounded one at a time, and each column's
rounding error is spread over the columns not yet rounded, weighted by the
inverse Hessian, so that the layer's output error `‖(W - Ŵ) X‖` stays small.
As in the paper: the error is carried through the Cholesky factor of `H⁻¹`
(upper, `H⁻¹ = Uᵀ U`); the columns go in blocks of 128, whose updates reach
the later columns as one matrix product per block ("lazy batch updates"); `H`
is damped by `percdamp` times its mean diagonal; optionally the columns go in
the order of decreasing `H` diagonal ("act-order"). A group's scale is fixed
from the weight as updated when the group's first column is reached, or from
the original weight beforehand ("static groups", always so with act-order, so
that the groups stay the consecutive inputs the stored layout expects).
"""

import dataclasses
import functools as ft

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._rounding import Grid, group_scale, round_to_grid


_BAD_OPTION_MSG = "`GPTQ`: `{name}` must be {what}; got {got!r}."


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """GPTQ's options, for `quantize(model, method=GPTQ(...), calibration=...)`
    (`method="gptq"` takes the defaults).

    **Arguments:**

    - `percdamp`: the damping added to the Hessian's diagonal, as a fraction of
        its mean diagonal (the paper's 0.01). More damping is more stable with
        few calibration rows and compensates less.
    - `act_order`: round the columns in the order of decreasing Hessian
        diagonal (the inputs with the most energy first), as GPTQ's `--act-order`.
        Group scales are then static.
    - `block_size`: how many columns are rounded before their errors reach the
        later columns in one matrix product (128 in the paper). The result is
        the same for every block size (up to rounding of floating point);
        larger blocks only trade loop steps for matrix products.
    - `static_groups`: compute every group's scale from the original weight
        before any rounding, rather than from the updated weight when the
        group's first column is reached.
    - `sequential`: quantise the selected weights one after another, in the
        model's tree order, each calibrated on the inputs it gets from the model
        with the weights before it already quantised (the paper's sequential
        mode), rather than all on the float model's inputs. It runs the
        calibration data once per weight (and compiles once per weight). Each
        weight still reproduces its own float output on those inputs, not the
        float model's: not always closer to the float model.

    !!! example

        ```python
        linear = eqx.nn.Linear(64, 8, key=jr.key(0))
        x = jr.normal(jr.key(1), (256, 64)) * jnp.linspace(0.1, 3.0, 64)
        calibration = [x[:128], x[128:]]  # each run as jax.vmap(linear)(batch)
        q = quantize(linear, bits=4, method=GPTQ(act_order=True), calibration=calibration)
        y = quaxlike.quaxify(q)(x[0])  # q.weight is an Int4Array
        ```
    """

    percdamp: float = 0.01
    act_order: bool = False
    block_size: int = 128
    static_groups: bool = False
    sequential: bool = False

    def __post_init__(self):
        if not (isinstance(self.percdamp, (int, float)) and self.percdamp >= 0):
            raise ValueError(
                _BAD_OPTION_MSG.format(name="percdamp", what="a float >= 0", got=self.percdamp)
            )
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise ValueError(
                _BAD_OPTION_MSG.format(
                    name="block_size", what="a positive int", got=self.block_size
                )
            )


def _inverse_hessian_factor(h: Array, percdamp: Array) -> Array:
    """The upper Cholesky factor `U` of `(H + damp I)⁻¹` (`H⁻¹ = Uᵀ U`)."""
    size = h.shape[-1]
    damp = percdamp * jnp.mean(jnp.diagonal(h))
    h = h + damp * jnp.eye(size, dtype=h.dtype)
    lower = jnp.linalg.cholesky(h)
    inverse = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(size, dtype=h.dtype))
    return jnp.linalg.cholesky(inverse).T


def _block(grid, w1, u1, fixed, scales, start, group, dtype):
    """Round the columns of one block `w1` `(out, count)` in order. `u1` is the
    block's square of `U`; `fixed` the scale of each column `(out, count)` when
    the groups are static, else `None` (a group's scale is taken at its first
    column, `group` columns wide, and rounded to `dtype`, the dtype it is stored
    in). Returns the codes, the errors scaled by the
    diagonal of `U`, and the groups' scales (updated in `scales`)."""
    out, count = w1.shape

    def column(i, carry):
        w1, codes, errors, scale, scales = carry
        w = lax.dynamic_index_in_dim(w1, i, axis=1, keepdims=False)
        if fixed is None:
            opening = lax.dynamic_slice_in_dim(w1, i, group, axis=1)
            opened = group_scale(grid, opening).astype(dtype).astype(w1.dtype)
            scale = jnp.where(i % group == 0, opened, scale)
            scales = lax.dynamic_update_index_in_dim(scales, scale, (start + i) // group, axis=1)
        else:
            scale = lax.dynamic_index_in_dim(fixed, i, axis=1, keepdims=False)
        code, q = round_to_grid(grid, w, scale)
        row = lax.dynamic_index_in_dim(u1, i, axis=0, keepdims=False)
        error = (w - q) / row[i]
        # U is upper triangular: this reaches column i (which becomes q) and later.
        w1 = w1 - error[:, None] * row[None, :]
        codes = lax.dynamic_update_index_in_dim(codes, code, i, axis=1)
        errors = lax.dynamic_update_index_in_dim(errors, error, i, axis=1)
        return w1, codes, errors, scale, scales

    init = (
        w1,
        jnp.zeros((out, count), jnp.int32),
        jnp.zeros_like(w1),
        jnp.ones(out, w1.dtype),
        scales,
    )
    _, codes, errors, _, scales = lax.fori_loop(0, count, column, init)
    return codes, errors, scales


# `grid` is static: its `code_max` a constant, as in `quantize_int4`, so that the
# scales are those of round-to-nearest to the last bit.
@ft.partial(jax.jit, static_argnames=("grid", "block_size", "act_order", "static_groups", "dtype"))
def _gptq_matrix(
    w, h, percdamp, fixed_scales, *, grid, block_size, act_order, static_groups, dtype
):
    out, size = w.shape
    group = grid.groups(size)
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    # Inputs that never were non-zero: any value does, so make them 0 (GPTQ's own).
    dead = jnp.diagonal(h) == 0
    h = h + jnp.diag(dead.astype(h.dtype))
    w = jnp.where(dead[None, :], 0.0, w)
    static = static_groups or act_order or grid.group_size is None or fixed_scales is not None
    if fixed_scales is None and static:
        groups = w.reshape(out, size // group, group)
        fixed_scales = group_scale(grid, groups)
    if fixed_scales is not None:
        # Rounded to the stored dtype first, so the codes fit the scales as stored.
        fixed_scales = fixed_scales.astype(dtype).astype(jnp.float32)
    perm = jnp.arange(size)
    if act_order:
        perm = jnp.argsort(-jnp.diagonal(h), stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_hessian_factor(h, percdamp)
    column_scales = None if fixed_scales is None else fixed_scales[:, perm // group]
    scales = jnp.ones((out, size // group), jnp.float32) if fixed_scales is None else fixed_scales
    # A group's scale is taken from within a block: blocks hold whole groups.
    block = block_size if static else -(-block_size // group) * group
    codes = []
    for start in range(0, size, block):
        stop = min(start + block, size)
        fixed = None if column_scales is None else column_scales[:, start:stop]
        block_codes, errors, scales = _block(
            grid, w[:, start:stop], u[start:stop, start:stop], fixed, scales, start, group, dtype
        )
        codes.append(block_codes)
        w = w.at[:, stop:].add(-errors @ u[start:stop, stop:])
    codes = jnp.concatenate(codes, axis=1)
    if act_order:
        codes = codes[:, jnp.argsort(perm)]
    return codes, scales.astype(dtype)


def gptq_codes(
    grid: Grid, w: Array, gram: Array, options: GPTQ, fixed_scales: Array | None = None
) -> tuple[Array, Array]:
    """GPTQ's codes `(*batch, out, in)` (`int32`) and group scales `(*batch, out,
    groups)` (in `w`'s dtype) for a weight `w` `(*batch, out, in)` whose inputs
    have the Gram matrix `gram` `(*batch, in, in)`.

    **Arguments:**

    - `grid`: the grid to round onto.
    - `w`, `gram`: the weight and its calibration statistics.
    - `options`: the `GPTQ` options.
    - `fixed_scales`: the groups' scales to round with `(*batch, out, groups)`,
        when they are given (NF4's double-quantised absmaxes), else `None`.

    **Returns:**

    The codes and the scales.
    """
    *batch, out, size = w.shape
    run = ft.partial(
        _gptq_matrix,
        percdamp=jnp.float32(options.percdamp),
        grid=grid,
        block_size=options.block_size,
        act_order=options.act_order,
        static_groups=options.static_groups,
        dtype=w.dtype,
    )
    if not batch:
        return run(w, gram, fixed_scales=fixed_scales)
    flat = (w.reshape(-1, out, size), gram.reshape(-1, size, size))
    if fixed_scales is None:
        codes, scales = jax.vmap(lambda w, h: run(w, h, fixed_scales=None))(*flat)
    else:
        fixed = fixed_scales.reshape(-1, *fixed_scales.shape[-2:])
        codes, scales = jax.vmap(lambda w, h, f: run(w, h, fixed_scales=f))(*flat, fixed)
    return codes.reshape(w.shape), scales.reshape(*batch, *scales.shape[1:])
