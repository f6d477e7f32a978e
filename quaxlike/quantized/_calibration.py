"""Input statistics of a model's weights on calibration data, for GPTQ and AWQ.

Each selected weight is wrapped in a `Recording`, a Value whose `dot_general`
rule returns the ordinary product and taps the operand it is multiplied with.
The statistics leave the program as derivatives, not as Python side effects:
a `Recording` carries zero "probe" arrays, and the tap is a `custom_vjp` whose
backward pass gives, as the cotangents of the probes, the statistics of the
inputs it saw. `collect_statistics` pulls a zero cotangent back through
`quaxify(run)(model, batch)` and reads them off the probes' cotangents. So they
come out of every transformation JAX can differentiate through (tested: `jit`,
`vmap`, `jax.checkpoint`, `lax.cond`, and `lax.scan` over a stack of layers, which slices the probes with the
weights, so that each layer's statistics land in its own slice); a
weight used several times sums the statistics of all its uses, which is the
objective of its output error summed over them. The price is one backward pass
per calibration batch, and a model that JAX can differentiate (no
`lax.while_loop` on the way from a weight to the output).

The statistics of a weight `(*batch, out, in)`, over the rows `x` (length
`in`) that meet its input axis:

- `gram`: `sum x xᵀ`, `(*batch, in, in)`, the Hessian of the layer's squared
    output error (GPTQ's `H`, up to a factor `2 / n`);
- `absum`: `sum |x|`, `(*batch, in)` (AWQ's activation magnitudes);
- `rows`: how many rows, `(*batch,)`.
"""

import dataclasses
import functools as ft
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

import quaxlike
from quaxlike.internal import bind_dot_general, ShapedArray

from ..selection import is_value, select, selected


_REFUSE_MSG = (
    "Recording (a weight of shape {shape} being calibrated for GPTQ or AWQ) was "
    "used other than as a factor of a matrix product (`dot_general`), so its input "
    "statistics cannot be recorded. Leave this weight out of `quantize` with `where=`, "
    'or use `method="rtn"`, which needs no calibration.'
)
_AXIS_MSG = (
    "`quantize`: a weight of shape {shape} being calibrated was multiplied along "
    "axes {axes} of the array it stands for, but GPTQ and AWQ quantise groups along the last axis "
    "(the input axis of an `eqx.nn.Linear` weight `(out, in)`), so they need a "
    "product that contracts exactly that axis (as `weight @ x` does) and keeps the "
    'output axis. Leave this weight out with `where=`, or use `method="rtn"`.'
)
_BATCH_MSG = (
    "`quantize`: a stacked weight of shape {shape} being calibrated was multiplied "
    "with its leading (stacking) axes {axes} contracted; each layer of a stack "
    "needs its own statistics. Index the stack (as `lax.scan` over it does), or "
    "leave this weight out with `where=`."
)
_NOT_A_WEIGHT_MSG = (
    "`quantize`: GPTQ and AWQ quantise floating-point weights `(*batch, out, in)`, "
    "as an `eqx.nn.Linear` holds them; `where=` selected {got}. Select weights only."
)
_NO_BATCHES_MSG = (
    "`quantize(method={method!r})` needs calibration data: pass `calibration=` an "
    "iterable of batches (each run as `jax.vmap(model)(batch)`, or by `run`), for "
    "example a few hundred rows of the data the model will see."
)
_RUN_FAILED_MSG = (
    "`quantize(method={method!r})`: running the model on calibration batch {index} "
    "({batch}) failed with {error_type}: {error}\nEach batch is run as "
    "`jax.vmap(model)(batch)`, so it needs a leading batch axis: shape `(batch, "
    "*input_shape)`. Pass batches of that shape, or give `run=lambda model, "
    "batch: ...` that runs the model on one batch as your model expects."
)
_UNUSED_MSG = (
    "`quantize(method={method!r})`: the selected weight{plural} {paths} never met "
    "an input during calibration (no row reached {them} in a matrix product whose "
    "result the model's floating-point output depends on), so there is nothing "
    "to calibrate {them} on. Check that `run` calls the model on the batches, or "
    "leave {them} out with `where=` (and quantise {them} separately with "
    '`method="rtn"`).'
)


class CalibrationError(ValueError):
    """A weight cannot be calibrated as the model uses it, or the calibration data
    cannot be run: the message says why and the way out.

    !!! example

        ```python
        linear = eqx.nn.Linear(64, 8, key=jr.key(0))
        try:  # one example, not a batch: jax.vmap(linear) maps over its features
            quantize(linear, bits=4, method="gptq", calibration=[jnp.ones(64)])
        except CalibrationError as error:
            assert "leading batch axis" in str(error)
        ```
    """


class Statistics(NamedTuple):
    """The input statistics of one weight `(*batch, out, in)` (see the module's
    docstring): `gram` `(*batch, in, in)`, `absum` `(*batch, in)` and `rows`
    `(*batch,)`, all `float32`."""

    gram: Array
    absum: Array
    rows: Array


class Recording(quaxlike.ArrayValue):
    """A weight that records the inputs it is multiplied with (see the module's
    docstring). It stands for `weight`; `gram`, `absum` and `rows` are zero
    probes, whose cotangents are the statistics.

    **Arguments:**

    - `weight`: the weight, `(*batch, out, in)`.
    - `gram`, `absum`, `rows`: zeros of the shapes of `Statistics`.
    - `transposed`: whether it stands for `weight` with its last two axes
        swapped (`weight.T`, as `x @ weight.T` uses it).
    """

    weight: Array
    gram: Array
    absum: Array
    rows: Array
    transposed: bool = eqx.field(static=True, default=False)

    def aval(self) -> ShapedArray:
        return ShapedArray(jnp.shape(self.logical()), self.weight.dtype)

    def logical(self) -> Array:
        """The array this stands for: `weight`, or `weight` with its last two
        axes swapped (as `weight.T` makes it)."""
        return jnp.swapaxes(self.weight, -1, -2) if self.transposed else self.weight

    def materialise(self) -> Any:
        raise CalibrationError(_REFUSE_MSG.format(shape=tuple(self.weight.shape)))


def _probes(weight: Any) -> tuple[Array, Array, Array]:
    """Zero probes for a weight `(*batch, out, in)`: `gram`, `absum`, `rows`."""
    shape = jnp.shape(weight)
    if len(shape) < 2 or not jnp.issubdtype(jnp.result_type(weight), jnp.floating):
        raise CalibrationError(_NOT_A_WEIGHT_MSG.format(got=describe_leaf(weight)))
    *batch, _, size = shape
    zeros = ft.partial(jnp.zeros, dtype=jnp.float32)
    return zeros((*batch, size, size)), zeros((*batch, size)), zeros(batch)


# --- the tap -----------------------------------------------------------------------


class _Layout(NamedTuple):
    """Where the rows of the other operand `x` are: `x` is transposed by
    `permutation` to `(*paired, *rows, in)`, where `paired` are the axes paired
    with the weight's leading axes `kept` (in the weight's order), and the
    statistics are broadcast to the weight's leading shape `batch`."""

    permutation: tuple[int, ...]
    n_paired: int
    kept: tuple[int, ...]
    batch: tuple[int, ...]


def _statistics(layout: _Layout, x: Array) -> Statistics:
    x = jnp.transpose(x, layout.permutation).astype(jnp.float32)
    paired = x.shape[: layout.n_paired]
    rows = x.reshape(*paired, -1, x.shape[-1])
    gram = jnp.einsum("...ni,...nj->...ij", rows, rows, precision=lax.Precision.HIGHEST)
    absum = jnp.sum(jnp.abs(rows), axis=-2)
    count = jnp.full(paired, rows.shape[-2], jnp.float32)
    # Leading axes of the weight that the product does not pair with `x` (one
    # `x` for every layer of a stack) get the same statistics in each slice.
    shape = [1] * len(layout.batch)
    for axis, size in zip(layout.kept, paired):
        shape[axis] = size

    def spread(s, tail):
        return jnp.broadcast_to(s.reshape(*shape, *tail), (*layout.batch, *tail))

    size = x.shape[-1]
    return Statistics(spread(gram, (size, size)), spread(absum, (size,)), spread(count, ()))


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(layout: _Layout, product, x, gram, absum, rows):
    del layout, x, gram, absum, rows
    return product


def _tap_fwd(layout, product, x, gram, absum, rows):
    del layout, gram, absum, rows
    return product, x


def _tap_bwd(layout, x, cotangent):
    stats = _statistics(layout, x)
    return (cotangent, jnp.zeros_like(x), *stats)


_tap.defvjp(_tap_fwd, _tap_bwd)


def _recorded_product(w: Recording, x, w_on_left: bool, dimension_numbers, params):
    (lc, rc), (lb, rb) = dimension_numbers
    w_contract, x_contract = (lc, rc) if w_on_left else (rc, lc)
    w_batch, x_batch = (lb, rb) if w_on_left else (rb, lb)
    ndim = w.weight.ndim
    shape = tuple(w.weight.shape)
    # The stored input axis, where the array stands for `weight.T`: its axis -2.
    input_axis = ndim - 2 if w.transposed else ndim - 1
    if any(a < ndim - 2 for a in w_contract):
        raise CalibrationError(_BATCH_MSG.format(shape=shape, axes=tuple(w_contract)))
    if tuple(w_contract) != (input_axis,) or any(a >= ndim - 2 for a in w_batch):
        raise CalibrationError(_AXIS_MSG.format(shape=shape, axes=tuple(w_contract)))
    # Pair the weight's leading axes with `x`'s batch axes, in the weight's order.
    order = sorted(range(len(w_batch)), key=lambda i: w_batch[i])
    kept = tuple(w_batch[i] for i in order)
    paired = [x_batch[i] for i in order]
    rows = [a for a in range(jnp.ndim(x)) if a not in paired and a != x_contract[0]]
    layout = _Layout((*paired, *rows, x_contract[0]), len(paired), kept, shape[:-2])
    lhs, rhs = (w.logical(), x) if w_on_left else (x, w.logical())
    product = bind_dot_general(lhs, rhs, dimension_numbers, params)
    return _tap(layout, product, x, w.gram, w.absum, w.rows)


@quaxlike.register(lax.transpose_p)
def transpose_p_recording(x: Recording, *, permutation, **params):
    k = x.ndim - 2
    if tuple(permutation[:k]) != tuple(range(k)):
        return NotImplemented  # moving a stacking axis: refused (materialise)
    if tuple(permutation[k:]) == (k, k + 1):
        return x
    return dataclasses.replace(x, transposed=not x.transposed)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_recording_any(lhs: Recording, rhs: ArrayLike, *, dimension_numbers, **params):
    return _recorded_product(lhs, rhs, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_recording(lhs: ArrayLike, rhs: Recording, *, dimension_numbers, **params):
    return _recorded_product(rhs, lhs, False, dimension_numbers, params)


# --- running the model on the calibration data ----------------------------------------


def default_run(model: Any, batch: Any) -> Any:
    """Equinox's convention: a model maps one example, so a batch is `jax.vmap`ped."""
    return jax.vmap(model)(batch)


def describe_leaf(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


def _describe(batch: Any) -> str:
    shapes = [f"{x.dtype}{list(x.shape)}" for x in jtu.tree_leaves(batch) if hasattr(x, "shape")]
    return ", ".join(shapes) or type(batch).__name__


def _is_float(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


@eqx.filter_jit
def _batch_statistics(probes, model, positions, run, batch):
    leaves, treedef = jtu.tree_flatten(model, is_leaf=is_value)

    def output(probes):
        for i, probe in zip(positions, probes):
            leaves[i] = Recording(leaves[i], *probe)
        out = quaxlike.quaxify(run)(jtu.tree_unflatten(treedef, leaves), batch)
        # Zero times the output: its cotangent is zero, and pulling it back runs
        # every tap's backward pass, which ignores it.
        return sum(
            (0.0 * jnp.sum(x)).astype(jnp.float32) for x in jtu.tree_leaves(out) if _is_float(x)
        )

    return jax.grad(output)(probes)


def collect_statistics(
    model: PyTree,
    where: Any,
    calibration: Iterable[Any],
    run: Callable[[Any, Any], Any] | None,
    method: str,
    positions: list[int] | None = None,
) -> tuple[list[int], list[Statistics]]:
    """Run `model` on every batch of `calibration` and sum the input statistics of
    the weights `where` selects.

    **Arguments:**

    - `model`: any PyTree holding the weights.
    - `where`: the selection of weights (any form `quaxlike.selection` takes).
    - `calibration`: an iterable of batches.
    - `run`: `run(model, batch)` runs the model on a batch; `None` for
        `jax.vmap(model)(batch)`.
    - `method`: the method's name, for error messages.
    - `positions`: the positions (as returned) of the weights to record, when
        only some of those `where` selects are wanted; `None` for all.

    **Returns:**

    The positions of the selected leaves among `jax.tree_util.tree_leaves(model,
    is_leaf=quaxlike.selection.is_value)`, and the `Statistics` of each.

    **Raises:**

    `ValueError` if there is no batch, a batch cannot be run, or a selected weight
    met no input.
    """
    run = default_run if run is None else run
    if positions is None:
        positions = selected(model, where, "quantize")
    leaves = jtu.tree_leaves(model, is_leaf=is_value)
    probes = [_probes(leaves[i]) for i in positions]
    total = None
    for index, batch in enumerate(calibration):
        try:
            stats = _batch_statistics(probes, model, tuple(positions), run, batch)
        except (CalibrationError, quaxlike.MaterialisationError):
            raise  # the model's use of a weight, not the batch: says what to do
        except Exception as error:
            raise CalibrationError(
                _RUN_FAILED_MSG.format(
                    method=method,
                    index=index,
                    batch=_describe(batch),
                    error_type=type(error).__name__,
                    error=error,
                )
            ) from error
        total = stats if total is None else jtu.tree_map(jnp.add, total, stats)
    if total is None:
        raise CalibrationError(_NO_BATCHES_MSG.format(method=method))
    stats = [Statistics(*s) for s in total]
    unused = [i for i, s in enumerate(stats) if not bool(jnp.all(s.rows > 0))]
    if unused:
        paths = dict(zip(selected(model, where, "quantize"), select(model, where)))
        names = ", ".join(f"`{paths[positions[i]]}`" for i in unused)
        many = len(unused) > 1
        raise CalibrationError(
            _UNUSED_MSG.format(
                method=method,
                plural="s" if many else "",
                paths=names,
                them="them" if many else "it",
            )
        )
    return positions, stats
