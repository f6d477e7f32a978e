"""Rows for reductions, cumulative and windowed reductions, shape manipulation,
indexing (slices, gather, scatter), sorting, `iota` and contractions."""

import jax
import jax.numpy as jnp
import numpy as np
from _inputs import boolean, c64, case, f32, i32, idx, pos, u32
from jax import lax
from jax._src.lax.windowed_reductions import _select_and_scatter


_ALL = (0, 1)
_DOT = (((1,), (0,)), ((), ()))
_BATCH_DOT = (((2,), (1,)), ((0,), (0,)))


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID")


def _select_and_scatter_ge(operand, source):
    return _select_and_scatter(
        operand, lax.ge, (2, 2), (2, 2), ((0, 0), (0, 0)), source, jnp.float32(0), lax.add
    )


CASES = [
    # --- reductions ---------------------------------------------------------------
    case("reduce_sum", jnp.sum, f32(3, 4), prims="reduce_sum"),
    case("reduce_sum-axis", lambda x: jnp.sum(x, axis=0), f32(3, 4), prims="reduce_sum"),
    case(
        "reduce_sum-keepdims", lambda x: x.sum(axis=1, keepdims=True), f32(3, 4), prims="reduce_sum"
    ),
    case("reduce_sum-int", jnp.sum, i32(3, 4), prims="reduce_sum"),
    case("reduce_sum-bool", lambda x: jnp.sum(x, axis=1), boolean(3, 4), prims="reduce_sum"),
    case("reduce_sum-complex", jnp.sum, c64(3, 4), prims="reduce_sum"),
    case("reduce_sum-lax", lambda x: lax.reduce_sum(x, (1,)), f32(3, 4), prims="reduce_sum"),
    case(
        "mean-var",
        lambda x: (jnp.mean(x), jnp.var(x, axis=0)),
        f32(3, 4),
        prims=("reduce_sum", "div"),
    ),
    case("reduce_max", lambda x: jnp.max(x, axis=1), f32(3, 4), prims="reduce_max"),
    case("reduce_min", jnp.min, f32(3, 4), prims="reduce_min"),
    case("reduce_max-int", lambda x: lax.reduce_max(x, (0,)), i32(3, 4), prims="reduce_max"),
    case("reduce_prod", lambda x: jnp.prod(x, axis=0), f32(3, 4), prims="reduce_prod"),
    case("reduce_and", lambda x: jnp.all(x, axis=1), boolean(3, 4), prims="reduce_and"),
    case("reduce_or", jnp.any, boolean(3, 4), prims="reduce_or"),
    case("reduce_xor", lambda x: lax.reduce_xor(x, (0,)), i32(3, 4), prims="reduce_xor"),
    case(
        "reduce_xor-ufunc",
        lambda x: jnp.bitwise_xor.reduce(x, axis=1),
        i32(3, 4),
        prims="reduce_xor",
    ),
    case("argmax", lambda x: jnp.argmax(x, axis=1), f32(3, 4), prims="argmax"),
    case("argmin", jnp.argmin, f32(3, 4), prims="argmin"),
    case("argmax-int", lambda x: lax.argmax(x, 0, jnp.int32), i32(3, 4), prims="argmax"),
    case(
        "reduce-generic",
        lambda x: lax.reduce(x, 0.0, lambda a, b: a + b * b, (0,)),
        f32(3, 4),
        prims="reduce",
    ),
    case(
        "reduce-variadic",
        lambda x, y: lax.reduce((x, y), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)),
        f32(3, 4),
        pos(3, 4),
        prims="reduce",
        grad=False,
    ),
    case("norm", jnp.linalg.norm, f32(3, 4), prims=("reduce_sum", "sqrt")),
    case(
        "logsumexp",
        lambda x: jax.nn.logsumexp(x, axis=1),
        f32(3, 4),
        prims=("reduce_max", "exp", "log"),
    ),
    case(
        "softmax",
        lambda x: jax.nn.softmax(x, axis=-1),
        f32(3, 4),
        prims=("reduce_max", "exp", "stop_gradient"),
    ),
    case("log_softmax", jax.nn.log_softmax, f32(3, 4), prims=("reduce_max", "log")),
    case("standardize", jax.nn.standardize, f32(3, 4), prims=("reduce_sum", "rsqrt")),
    case(
        "one_hot",
        lambda i: jax.nn.one_hot(i, 5),
        idx(4, high=5),
        prims=("eq", "iota"),
        valueless="iota",
    ),
    case("median", jnp.median, f32(7), prims="sort"),
    case("nanmean", jnp.nanmean, f32(3, 4), prims=("ne", "select_n", "reduce_sum")),
    # --- cumulative ---------------------------------------------------------------
    case("cumsum", lambda x: jnp.cumsum(x, axis=1), f32(3, 4), prims="cumsum"),
    case(
        "cumsum-reverse", lambda x: lax.cumsum(x, axis=0, reverse=True), f32(3, 4), prims="cumsum"
    ),
    case("cumsum-int", jnp.cumsum, i32(3, 4), prims="cumsum"),
    case("cumprod", lambda x: jnp.cumprod(x, axis=0), f32(3, 4), prims="cumprod"),
    case("cummax", lambda x: lax.cummax(x, axis=1), f32(3, 4), prims="cummax"),
    case("cummin", lambda x: lax.cummin(x, axis=0), f32(3, 4), prims="cummin"),
    case("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), f32(3, 4), prims="cumlogsumexp"),
    case(
        "associative_scan",
        lambda x: lax.associative_scan(jnp.add, x, axis=1),
        f32(3, 8),
        prims=("add", "slice", "pad"),
    ),
    # --- windowed reductions ------------------------------------------------------
    case(
        "reduce_window_sum",
        lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
        f32(4, 6),
        prims="reduce_window_sum",
    ),
    case("reduce_window_max", _max_pool, f32(4, 6), prims="reduce_window_max"),
    case(
        "reduce_window_min",
        lambda x: lax.reduce_window(x, jnp.inf, lax.min, (2, 2), (1, 2), "SAME"),
        f32(4, 6),
        prims="reduce_window_min",
    ),
    case(
        "reduce_window-generic",
        lambda x: lax.reduce_window(x, 0.0, lambda a, b: a + b * b, (2, 2), (1, 1), "VALID"),
        f32(4, 6),
        prims="reduce_window",
        grad=False,
    ),
    case(
        "select_and_scatter_add",
        lambda x: jax.grad(lambda y: _max_pool(y).sum())(x),
        f32(4, 6),
        prims="select_and_scatter_add",
        grad=False,
    ),
    case(
        "select_and_gather_add",
        lambda x, t: jax.jvp(_max_pool, (x,), (t,)),
        f32(4, 6),
        f32(4, 6),
        prims="select_and_gather_add",
        grad=False,
    ),
    case(
        "select_and_scatter",
        _select_and_scatter_ge,
        f32(4, 6),
        f32(2, 3),
        prims="select_and_scatter",
        grad=False,
        vmap=False,
    ),
    case(
        "avg_pool-conv_style",
        lambda x: jnp.convolve(x, jnp.ones(3, x.dtype) / 3, mode="valid"),
        f32(8),
        prims="conv_general_dilated",
    ),
    # --- shapes -------------------------------------------------------------------
    case("reshape", lambda x: x.reshape(4, 3), f32(3, 4), prims="reshape"),
    case("ravel", jnp.ravel, f32(3, 4), prims="reshape"),
    case("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), f32(2, 3, 4), prims="transpose"),
    case("transpose-T", lambda x: x.T, f32(3, 4), prims="transpose"),
    case("squeeze", lambda x: jnp.squeeze(x, axis=1), f32(3, 1, 4), prims="squeeze"),
    case("expand_dims", lambda x: jnp.expand_dims(x, 1), f32(3, 4), prims="broadcast_in_dim"),
    case("none-index", lambda x: x[:, None], f32(3, 4), prims="broadcast_in_dim"),
    case(
        "broadcast_in_dim",
        lambda x: jnp.broadcast_to(x, (2, 3, 4)),
        f32(3, 4),
        prims="broadcast_in_dim",
    ),
    case(
        "broadcast_in_dim-lax",
        lambda x: lax.broadcast_in_dim(x, (3, 2, 4), (0, 2)),
        f32(3, 4),
        prims="broadcast_in_dim",
    ),
    case(
        "concatenate",
        lambda x, y: jnp.concatenate([x, y], axis=0),
        f32(3, 4),
        f32(2, 4),
        prims="concatenate",
    ),
    case(
        "concatenate-mixed-dtype",
        lambda x, y: jnp.concatenate([x, y]),
        f32(3),
        i32(2),
        prims=("concatenate", "convert_element_type"),
        loose_promotion=True,
    ),
    case("hstack", lambda x, y: jnp.hstack([x, y]), f32(3, 4), f32(3, 2), prims="concatenate"),
    case("stack", lambda x, y: jnp.stack([x, y]), f32(3, 4), f32(3, 4), prims="stack"),
    case("stack-lax", lambda x, y: lax.stack([x, y], axis=1), f32(3, 4), f32(3, 4), prims="stack"),
    case("unstack", lambda x: lax.unstack(x, axis=1), f32(3, 4), prims="unstack"),
    case("split", lambda x: jnp.split(x, 2, axis=1), f32(3, 4), prims="split"),
    case("split-lax", lambda x: lax.split(x, (1, 3), axis=0), f32(4, 2), prims="split"),
    case("tile", lambda x: jnp.tile(x, (2, 1)), f32(3, 4), prims="tile"),
    case(
        "repeat",
        lambda x: jnp.repeat(x, 2, axis=0),
        f32(3, 4),
        prims=("broadcast_in_dim", "reshape"),
    ),
    case("pad", lambda x: jnp.pad(x, ((1, 2), (0, 1))), f32(3, 4), prims="pad"),
    case(
        "pad-lax-interior-negative",
        lambda x: lax.pad(x, 0.0, ((1, -1, 1), (0, 0, 0))),
        f32(3, 4),
        prims="pad",
    ),
    case(
        "pad-value-operand",
        lambda x, v: lax.pad(x, v, ((1, 1, 0), (2, 0, 1))),
        f32(3, 4),
        jnp.float32(7.0),
        prims="pad",
    ),
    case(
        "pad-reflect", lambda x: jnp.pad(x, 2, mode="reflect"), f32(5), prims=("rev", "concatenate")
    ),
    case("rev", lambda x: jnp.flip(x, axis=1), f32(3, 4), prims="rev"),
    case("roll", lambda x: jnp.roll(x, 1, axis=0), f32(3, 4), prims=("slice", "concatenate")),
    case("rot90", jnp.rot90, f32(3, 4), prims=("rev", "transpose")),
    case("tril", jnp.tril, f32(4, 4), prims=("iota", "select_n"), valueless="iota"),
    case(
        "eye-matmul",
        lambda x: jnp.eye(3, dtype=x.dtype) @ x,
        f32(3, 4),
        prims=("iota", "dot_general"),
        valueless="iota",
    ),
    case(
        "iota-arange-add",
        lambda x: x + jnp.arange(4, dtype=x.dtype),
        f32(3, 4),
        prims=("iota", "add"),
        valueless="iota",
        loose_promotion=True,
    ),
    case(
        "iota-broadcasted",
        lambda x: x * lax.broadcasted_iota(jnp.int32, (3, 4), 1),
        i32(3, 4),
        prims=("iota", "mul"),
        valueless="iota",
    ),
    case(
        "empty",
        lambda x: lax.empty((3, 4), jnp.float32).shape[0] * x,
        f32(3, 4),
        prims=("empty", "mul"),
        valueless="empty",
    ),
    # --- slicing and indexing -----------------------------------------------------
    case("slice", lambda x: x[1:3, ::2], f32(4, 5), prims="slice"),
    case("slice-lax", lambda x: lax.slice(x, (0, 1), (3, 5), (2, 2)), f32(4, 5), prims="slice"),
    case("int-index", lambda x: x[2], f32(4, 5), prims=("slice", "squeeze")),
    case("negative-index", lambda x: x[-1, 1:], f32(4, 5), prims="slice"),
    case(
        "dynamic_slice",
        lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 3)),
        f32(4, 5),
        jnp.int32(1),
        prims="dynamic_slice",
    ),
    case(
        "dynamic_slice-clamped",
        lambda x, i: lax.dynamic_slice_in_dim(x, i, 3, axis=1),
        f32(4, 5),
        jnp.int32(4),
        prims="dynamic_slice",
    ),
    case("dynamic_index", lambda x, i: x[i], f32(4, 5), jnp.int32(2), prims="dynamic_slice"),
    case(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
        f32(4, 5),
        f32(2, 5),
        jnp.int32(2),
        prims="dynamic_update_slice",
    ),
    case(
        "dynamic_update_index",
        lambda x, u, i: lax.dynamic_update_index_in_dim(x, u, i, 0),
        f32(4, 5),
        f32(5),
        jnp.int32(3),
        prims="dynamic_update_slice",
    ),
    case("gather", lambda x, i: x[i], f32(4, 5), idx(3, high=4), prims="gather"),
    case(
        "gather-2d",
        lambda x, i, j: x[i, j],
        f32(4, 5),
        idx(2, high=4),
        idx(2, high=5),
        prims="gather",
    ),
    case(
        "gather-negative-and-oob",
        lambda x, i: x.at[i].get(mode="fill", fill_value=-1.0),
        f32(4, 5),
        jnp.array([-1, 7, 2], jnp.int32),
        prims="gather",
    ),
    case("take", lambda x, i: jnp.take(x, i, axis=1), f32(3, 5), idx(4, high=5), prims="gather"),
    case(
        "take_along_axis",
        lambda x, i: jnp.take_along_axis(x, i, axis=1),
        f32(3, 4),
        idx(3, 2, high=4),
        prims="gather",
    ),
    case(
        "gather-static-bool-mask",
        lambda x: x[np.array([True, False, True, False])],
        f32(4, 5),
        prims="gather",
    ),
    case(
        "gather-lax",
        lambda x, i: lax.gather(
            x,
            i,
            lax.GatherDimensionNumbers(
                offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
            ),
            (1, 5),
        ),
        f32(4, 5),
        idx(3, 1, high=4),
        prims="gather",
    ),
    case("diag", jnp.diag, f32(4, 4), prims="gather"),
    case("scatter", lambda x, v: x.at[1].set(v), f32(4, 5), f32(5), prims="scatter"),
    case(
        "scatter-indices",
        lambda x, i, v: x.at[i].set(v),
        f32(4, 5),
        jnp.array([3, 1], jnp.int32),
        f32(2, 5),
        prims="scatter",
    ),
    case(
        "scatter-add",
        lambda x, i, v: x.at[i].add(v),
        f32(4, 5),
        jnp.array([0, 2, 0], jnp.int32),
        f32(3, 5),
        prims="scatter-add",
    ),
    case(
        "scatter-sub",
        lambda x, i, v: x.at[i].subtract(v),
        f32(4, 5),
        jnp.array([0, 2, 0], jnp.int32),
        f32(3, 5),
        prims="scatter-sub",
    ),
    case("scatter-mul", lambda x: x.at[:, 1].multiply(3.0), f32(4, 5), prims="scatter-mul"),
    case(
        "scatter-min",
        lambda x, i, v: x.at[i].min(v),
        f32(4, 5),
        jnp.array([1, 1], jnp.int32),
        f32(2, 5),
        prims="scatter-min",
    ),
    case(
        "scatter-max",
        lambda x, i, v: x.at[i].max(v),
        f32(4, 5),
        jnp.array([3, 0], jnp.int32),
        f32(2, 5),
        prims="scatter-max",
    ),
    case("scatter-int", lambda x, i: x.at[i].add(1), i32(6), idx(4, high=6), prims="scatter-add"),
    case(
        "segment_sum",
        lambda x, s: jax.ops.segment_sum(x, s, num_segments=3),
        f32(6, 2),
        idx(6, high=3),
        prims="scatter-add",
    ),
    case("bincount", lambda i: jnp.bincount(i, length=5), idx(8, high=5), prims="scatter-add"),
    # data-dependent output shapes made static with `size=`
    case(
        "nonzero-size",
        lambda x: jnp.nonzero(x > 0, size=6, fill_value=-1),
        f32(3, 4),
        prims="cumsum",
    ),
    case("argwhere-size", lambda x: jnp.argwhere(x > 0, size=6), f32(3, 4), prims="cumsum"),
    case(
        "unique-size",
        lambda x: jnp.unique(x, size=5, fill_value=0),
        i32(8, low=0, high=4),
        prims="sort",
    ),
    case(
        "compress-size", lambda c, x: jnp.compress(c, x, size=3), boolean(5), f32(5), prims="gather"
    ),
    # --- sorting ------------------------------------------------------------------
    case("sort", lambda x: jnp.sort(x, axis=-1), f32(3, 5), prims="sort"),
    case("sort-int", jnp.sort, i32(7), prims="sort"),
    case(
        "argsort",
        lambda x: jnp.argsort(x, axis=0),
        f32(3, 5),
        prims=("sort", "iota"),
        valueless="iota",
    ),
    case("sort-multi", lambda k, v: lax.sort((k, v), num_keys=1), f32(6), i32(6), prims="sort"),
    case("sort_key_val", lax.sort_key_val, i32(6), f32(6), prims="sort"),
    case(
        "lexsort",
        lambda a, b: jnp.lexsort((a, b)),
        i32(6, low=0, high=3),
        i32(6, low=0, high=3),
        prims="sort",
    ),
    case("top_k", lambda x: lax.top_k(x, 2), f32(3, 5), prims="top_k"),
    case("approx_top_k", lambda x: lax.approx_max_k(x, 2), f32(3, 5), prims="approx_top_k"),
    case("approx_min_k", lambda x: lax.approx_min_k(x, 2), f32(3, 5), prims="approx_top_k"),
    case(
        "searchsorted-sort",
        lambda a, v: jnp.searchsorted(a, v, method="sort"),
        jnp.arange(5.0),
        f32(4),
        prims=("sort", "scatter"),
    ),
    case(
        "searchsorted-lt_to",
        lambda a, v: jnp.searchsorted(a, v, method="compare_all"),
        jnp.arange(5.0),
        f32(4),
        prims="lt_to",
    ),
    case(
        "searchsorted-le_to",
        lambda a, v: jnp.searchsorted(a, v, side="right", method="compare_all"),
        jnp.arange(5.0),
        f32(4),
        prims="le_to",
    ),
    case(
        "searchsorted-eq_to",
        lambda a, v: jnp.searchsorted(a, v, method="compare_all"),
        jnp.arange(5.0).astype(jnp.complex64),
        c64(4),
        prims=("eq_to", "lt_to"),
    ),
    case(
        "searchsorted-scan",
        jnp.searchsorted,
        jnp.arange(5.0),
        f32(4),
        prims="scan",
        all_values=False,
    ),
    # --- contractions -------------------------------------------------------------
    case(
        "dot_general",
        lambda x, y: lax.dot_general(x, y, _DOT),
        f32(3, 4),
        f32(4, 5),
        prims="dot_general",
    ),
    case(
        "dot_general-batch",
        lambda x, y: lax.dot_general(x, y, _BATCH_DOT),
        f32(2, 3, 4),
        f32(2, 4, 5),
        prims="dot_general",
    ),
    case(
        "dot_general-preferred",
        lambda x, y: lax.dot_general(x, y, _DOT, preferred_element_type=jnp.float32),
        i32(3, 4),
        i32(4, 2),
        prims="dot_general",
    ),
    case("matmul", jnp.matmul, f32(3, 4), f32(4, 5), prims="dot_general"),
    case("matmul-operator", lambda x, y: x @ y, f32(2, 3, 4), f32(2, 4, 5), prims="dot_general"),
    case("matvec", jnp.matmul, f32(3, 4), f32(4), prims="dot_general"),
    case("matmul-int", jnp.matmul, i32(3, 4), i32(4, 2), prims="dot_general"),
    case("matmul-complex", jnp.matmul, c64(3, 4), c64(4, 2), prims="dot_general"),
    case(
        "matmul-mixed", jnp.matmul, f32(3, 4), i32(4, 2), prims="dot_general", loose_promotion=True
    ),
    case(
        "einsum",
        lambda x, y: jnp.einsum("ij,jk->ik", x, y),
        f32(3, 4),
        f32(4, 5),
        prims="dot_general",
    ),
    case(
        "einsum-batch",
        lambda x, y: jnp.einsum("bij,bjk->bki", x, y),
        f32(2, 3, 4),
        f32(2, 4, 5),
        prims="dot_general",
    ),
    case(
        "tensordot",
        lambda x, y: jnp.tensordot(x, y, axes=2),
        f32(2, 3, 4),
        f32(3, 4, 2),
        prims="dot_general",
    ),
    case("outer", jnp.outer, f32(3), f32(4), prims="mul"),
    case(
        "conv_general_dilated",
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
        f32(2, 3, 6, 6),
        f32(4, 3, 3, 3),
        prims="conv_general_dilated",
    ),
    case(
        "conv-strided-dilated",
        lambda x, w: lax.conv_general_dilated(
            x, w, (2, 1), "VALID", lhs_dilation=(1, 1), rhs_dilation=(1, 2)
        ),
        f32(1, 2, 7, 7),
        f32(3, 2, 3, 2),
        prims="conv_general_dilated",
    ),
    case(
        "conv-grouped",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), "SAME", feature_group_count=2),
        f32(1, 4, 6),
        f32(4, 2, 3),
        prims="conv_general_dilated",
    ),
    case(
        "conv_transpose",
        lambda x, w: lax.conv_transpose(
            x, w, (2,), "SAME", dimension_numbers=("NCH", "OIH", "NCH")
        ),
        f32(1, 2, 5),
        f32(3, 2, 3),
        prims="conv_general_dilated",
    ),
    case("convolve", jnp.convolve, f32(8), f32(3), prims="conv_general_dilated"),
    case(
        "ragged_dot_general",
        lax.ragged_dot,
        f32(6, 3),
        f32(2, 3, 4),
        jnp.array([2, 4], jnp.int32),
        prims="ragged_dot_general",
    ),
    case(
        "scaled_dot",
        lambda x, y: lax.scaled_dot(x, y),
        f32(4, 3),
        f32(3, 4),
        prims="scaled_dot",
        grad=False,
    ),
    case(
        "bitcast-uint-index",
        lambda x, i: x[i.astype(jnp.int32) % 4],
        f32(4, 3),
        u32(5, high=100),
        prims=("rem", "gather"),
    ),
]
