"""Einsum-style labels for `dot_general`, for rules that rearrange a product."""

import jax
from jax import lax

from .. import _jax_compat as jc


def dot_general_labels(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Label every dimension of a `dot_general`'s operands and output.

    **Arguments:**

    - `dimension_numbers`: the primitive's `((lhs_contract, rhs_contract),
        (lhs_batch, rhs_batch))`.
    - `lhs_ndim`, `rhs_ndim`: the operands' ranks.

    **Returns:**

    `(lhs, rhs, out)`: lists of int labels, one per dimension. Contracted and batch
    pairs share a label; labels are below `lhs_ndim + rhs_ndim`, so larger ints are
    free for new dimensions. `out` is laid out as `dot_general` lays out its result.

    !!! example

        ```python
        # a batched matrix product: (batch, m, k) x (batch, k, n)
        lhs, rhs, out = quaxlike.internal.dot_general_labels(
            (((2,), (1,)), ((0,), (0,))), lhs_ndim=3, rhs_ndim=3
        )
        assert lhs == [0, 1, 2] and rhs == [0, 2, 5] and out == [0, 1, 5]
        ```
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs = list(range(lhs_ndim))
    rhs = list(range(lhs_ndim, lhs_ndim + rhs_ndim))
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        rhs[j] = lhs[i]
    lhs_free = [lhs[i] for i in range(lhs_ndim) if i not in lc and i not in lb]
    rhs_free = [rhs[j] for j in range(rhs_ndim) if j not in rc and j not in rb]
    return lhs, rhs, [lhs[i] for i in lb] + lhs_free + rhs_free


def contract_labelled(x, x_labels: list, y, y_labels: list, keep: set, params: dict):
    """`dot_general` of two labelled operands: shared labels in `keep` become batch
    dimensions, the other shared labels are contracted.

    **Arguments:**

    - `x`, `y`: the operands, with one label per dimension in `x_labels`, `y_labels`.
    - `keep`: labels that must survive (still needed by a later step or the output).
    - `params`: the original `dot_general` params (`precision` and
        `preferred_element_type` are passed on).

    **Returns:**

    The result and its labels: batch, then `x`'s free, then `y`'s free.

    !!! example

        ```python
        # `x @ y` with y = a @ b, without forming a @ b: contract label 1, then 2
        x, a, b = jnp.ones((3, 4)), jnp.ones((4, 2)), jnp.ones((2, 5))
        xa, labels = quaxlike.internal.contract_labelled(x, [0, 1], a, [1, 2], set(), {})
        out, labels = quaxlike.internal.contract_labelled(xa, labels, b, [2, 3], set(), {})
        assert labels == [0, 3] and jnp.allclose(out, x @ (a @ b))
        ```
    """
    shared = [label for label in x_labels if label in y_labels]
    batch = [label for label in shared if label in keep]
    contract = [label for label in shared if label not in keep]
    dimension_numbers = (
        (tuple(x_labels.index(c) for c in contract), tuple(y_labels.index(c) for c in contract)),
        (tuple(x_labels.index(b) for b in batch), tuple(y_labels.index(b) for b in batch)),
    )
    out = bind_dot_general(x, y, dimension_numbers, {**params, "out_sharding": None})
    labels = (
        batch
        + [label for label in x_labels if label not in shared]
        + [label for label in y_labels if label not in shared]
    )
    return out, labels


def bind_dot_general(x, y, dimension_numbers, params: dict):
    """`lax.dot_general(x, y, dimension_numbers)` with the `precision`,
    `preferred_element_type` and `out_sharding` of `params`, the params of a
    `dot_general` equation a rule received.

    Binds `lax.dot_general_p` directly when `params` came from an equation (so
    they are already in canonical form) and neither operand carries an explicit
    sharding: the `lax.dot_general` wrapper's argument checking costs more at
    trace time than the equation it emits. Otherwise calls the wrapper.

    **Arguments:**

    - `x`, `y`: the operands (arrays, tracers, or Values lifted by the current
        `quaxify`).
    - `dimension_numbers`: `((x_contract, y_contract), (x_batch, y_batch))`, as
        tuples of ints.
    - `params`: the other params of a `dot_general` equation (`precision`,
        `preferred_element_type`, `out_sharding`); `{}` means the defaults.

    **Returns:**

    The product, as `lax.dot_general` would return it.

    !!! example

        ```python
        class Doubled(quaxlike.ArrayValue):  # stands for 2 * array
            array: jax.Array

            def aval(self):
                return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

            def materialise(self):
                return 2 * self.array

        @quaxlike.register(jax.lax.dot_general_p)
        def _(x: Doubled, y: jax.Array, *, dimension_numbers, **params):
            # (2 A) y as 2 (A y), with the equation's own params
            product = quaxlike.internal.bind_dot_general(x.array, y, dimension_numbers, params)
            return 2 * product

        w, v = jnp.ones((3, 2)), jnp.ones(2)
        out = quaxlike.quaxify(lambda w, v: w @ v)(Doubled(w), v)
        assert jnp.allclose(out, 2 * (w @ v))
        ```
    """
    if "precision" in params and _unsharded(x) and _unsharded(y):
        return lax.dot_general_p.bind(
            x,
            y,
            dimension_numbers=dimension_numbers,
            precision=params["precision"],
            preferred_element_type=params.get("preferred_element_type"),
            out_sharding=params.get("out_sharding"),
        )
    return lax.dot_general(
        x,
        y,
        dimension_numbers,
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
        out_sharding=params.get("out_sharding"),
    )


def _unsharded(x) -> bool:
    return jc.without_mesh(jax.typeof(x))
