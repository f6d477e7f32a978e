"""Many adapters over one base: `MultiLoraArray`, `stack_adapters`, `with_adapter`.

A serving batch in which request `i` uses adapter `k(i)` out of `N` that share one
frozen base computes `y_i = W x_i + A[k(i)] (B[k(i)] x_i)`. `stack_adapters` puts
the `N` adapters' factors side by side over one `W` (dense or quantised), and
`with_adapter(model, k)` picks adapter `k` as an ordinary `LoraArray`. Under
`jax.vmap` over the requests, `k` is traced: each request gathers its own factors
(`O((m + n) r)` each) while `W` stays unbatched, so the product `W x_i` runs on the
one base for the whole batch. Neither `N` copies of `W` nor a merged
`W + A[k] B[k]` is ever built.
"""

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import ArrayLike, PRNGKeyArray, PyTree

import quaxlike
from quaxlike.internal import logical_entries, ShapedArray

from ..selection import dotted_path, is_value
from ._base import LowRankValue, shape_of
from ._conv import LoraConvKernel
from ._model import loraify
from ._value import LoraArray, matrix_factor_leaf_specs


_REFUSE_MSG = (
    "Refusing to use a {cls} of shape {shape} as one array: it holds several LoRA "
    "adapters over one base, and a primitive needs a single weight. Pick the adapter "
    "for each request with `quaxlike.lora.with_adapter(model, k)`, under "
    "`jax.vmap` over the requests for a batch: "
    "`jax.vmap(lambda k, x: quaxify(with_adapter(model, k))(x))(ids, xs)`."
)
_NO_MERGE_MSG = (
    "`merge` got a MultiLoraArray, which holds {n} adapters over one base: merging "
    "would build {n} dense weights. Pick one first: `merge(with_adapter(model, k))`."
)
_NOT_LORA_MSG = (
    "`stack_adapters` needs LoRA models (the output of `loraify`, `qlora` or "
    "`load_peft`) of one structure; model {i} differs from model 0 {where}."
)
_OTHER_BASE_MSG = (
    "`stack_adapters` needs adapters over one base, but model {i}'s `{path}` differs "
    "from model 0's. Build every adapter from the same base model (for example "
    "`loraify(base, ...)` with different keys, or `load_peft(base, ...)`)."
)
_RANKS_MSG = (
    "`stack_adapters`: the adapters at `{path}` have ranks {ranks}; stacking needs one "
    "rank. Pad the smaller ones with zero columns of `A` and rows of `B` (which "
    "changes nothing), or serve them in separate groups."
)


class MultiLoraArray(LowRankValue):
    """`N` low-rank adapters over one frozen weight `W`.

    `W` has shape `(*batch, m, n)` (or is a Value, such as an `Int4Array`); `A`
    has shape `(N, *batch, m, rank)` and `B` `(N, *batch, rank, n)`. It stands for
    the `N` weights `W + A[k] @ B[k]`, stacked, but is not meant to be used as one
    array: `with_adapter(model, k)` picks adapter `k` as a `LoraArray` sharing `W`,
    and under `jax.vmap` over requests each request picks its own. Any primitive
    on the stack itself raises an error naming `with_adapter`.

    **Arguments:** see `LoraArray.from_factors`; build it with `stack_adapters`.

    !!! example

        ```python
        base = eqx.nn.Linear(3, 2, key=jr.key(0))
        bank = multi_loraify(base, count=4, rank=1, key=jr.key(1))
        assert isinstance(bank.weight, MultiLoraArray) and bank.weight.count == 4
        ```
    """

    refuse_message: ClassVar[str] = _REFUSE_MSG

    @property
    def count(self) -> int:
        """How many adapters it holds (the first dimension of `a`)."""
        return shape_of(self.a)[0]

    def aval(self) -> ShapedArray:
        base = super().aval()
        return ShapedArray((self.count, *base.shape), base.dtype)

    def logical_leaf_specs(self, spec: Any) -> "MultiLoraArray":
        """How `W`, `A` and `B` follow a sharding of the stack `(N, *batch, m, n)`
        (see `quaxlike.leaf_specs`): `W`, shared by the adapters, like one of them;
        `A` and `B` along the adapters and, as in `LoraArray`, `A` along the rows
        and `B` along the columns.

        **Arguments:**

        - `spec`: a `PartitionSpec` of `(N, *batch, m, n)`.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """

        def shared_weight_specs(spec):  # W has no adapter axis: the spec without it
            entries = logical_entries(spec, self.logical_ndim())
            return self.weight_leaf_specs(PartitionSpec(*entries[1:]))

        return matrix_factor_leaf_specs(self, spec, shared_weight_specs)

    def logical_ndim(self) -> int:
        if self.a is not None or self.b is not None:
            return len(shape_of(self.a if self.a is not None else self.b))
        return len(shape_of(self.w)) + 1

    def dense_from(self, w: Any, a: Any, b: Any) -> Any:
        """The `N` weights `w + a[k] @ b[k]`, stacked."""
        return quaxlike.quaxify(lambda w, a, b: w + jnp.matmul(a, b))(w, a, b)

    def merged(self) -> Any:
        raise ValueError(_NO_MERGE_MSG.format(n=self.count))

    def adapter(self, k: ArrayLike) -> LoraArray:
        """Adapter `k` as a `LoraArray` over the shared `W`.

        **Arguments:**

        - `k`: an integer index, concrete or traced (under `jax.vmap` over requests
            each request gets its own).

        **Returns:**

        A `LoraArray` whose `w` is this stack's `w` itself.
        """
        take = quaxlike.quaxify(lambda v: jnp.take(v, k, axis=0, mode="clip"))
        return LoraArray.from_factors(
            self.w,
            take(self.a),
            take(self.b),
            allow_materialise=self.allow_materialise,
            stop_gradient=self.stop_gradient,
        )


def _is_lora(x: Any) -> bool:
    return isinstance(x, LowRankValue)


def _same_array(x: Any, y: Any) -> bool:
    if x is y:
        return True
    leaves_x, leaves_y = jtu.tree_leaves(x), jtu.tree_leaves(y)
    if len(leaves_x) != len(leaves_y):
        return False
    for u, v in zip(leaves_x, leaves_y):
        if u is v:
            continue
        if not (isinstance(u, jax.Array) and isinstance(v, jax.Array)):
            if shape_of(u) != shape_of(v):
                return False
            continue  # abstract (eval_shape) or non-array leaves: shapes suffice
        try:
            if u.shape != v.shape or not np.array_equal(np.asarray(u), np.asarray(v)):
                return False
        except jax.errors.TracerArrayConversionError:
            continue  # traced: nothing to compare
    return True


def stack_adapters(models: Sequence[PyTree]) -> PyTree:
    """Put the LoRA adapters of several models over one base side by side.

    **Arguments:**

    - `models`: LoRA models of one structure (from `loraify`, `qlora` or
        `load_peft`) over the same frozen base: the same weights `W` (the same
        arrays, or equal ones) and the same other leaves, with adapters of one rank
        at the same places.

    **Returns:**

    The first model with each `LoraArray` replaced by a `MultiLoraArray` holding
    every model's `A` and `B` (stacked along a new first axis) over the one `W`.
    `with_adapter(stacked, k)` gives back model `k`.

    **Raises:**

    `ValueError` if the models differ in structure, in their base or in rank.

    !!! example

        ```python
        base = eqx.nn.MLP(4, 2, 8, depth=1, key=jr.key(0))
        adapters = [loraify(base, rank=2, key=jr.key(i), scale=0.1) for i in range(3)]
        bank = stack_adapters(adapters)
        xs, ids = jnp.ones((5, 4)), jnp.array([0, 2, 1, 2, 0])
        ys = jax.vmap(lambda k, x: quaxlike.quaxify(with_adapter(bank, k))(x))(ids, xs)
        alone = quaxlike.quaxify(adapters[2])(xs[1])
        assert jnp.allclose(ys[1], alone, atol=1e-6)
        ```
    """
    if not models:
        raise ValueError("`stack_adapters` needs at least one model.")
    flat = [jtu.tree_flatten_with_path(m, is_leaf=is_value) for m in models]
    first, treedef = flat[0]
    for i, (leaves, other) in enumerate(flat[1:], start=1):
        if other != treedef:
            raise ValueError(_NOT_LORA_MSG.format(i=i, where="in structure"))
    out = []
    for position, (key_path, leaf) in enumerate(first):
        column = [leaves[position][1] for leaves, _ in flat]
        path = dotted_path(key_path)
        if isinstance(leaf, LoraConvKernel) or isinstance(leaf, MultiLoraArray):
            raise ValueError(
                f"`stack_adapters`: `{path}` is a {type(leaf).__name__}; only "
                "LoraArray adapters can be stacked."
            )
        if not isinstance(leaf, LoraArray):
            for i, other in enumerate(column[1:], start=1):
                if not _same_array(leaf, other):
                    raise ValueError(_OTHER_BASE_MSG.format(i=i, path=path))
            out.append(leaf)
            continue
        for i, other in enumerate(column[1:], start=1):
            if not isinstance(other, LoraArray):
                raise ValueError(_NOT_LORA_MSG.format(i=i, where=f"at `{path}`"))
            if not _same_array(leaf.w, other.w):
                raise ValueError(_OTHER_BASE_MSG.format(i=i, path=path))
        ranks = sorted({x.rank for x in column})
        if len(ranks) > 1:
            raise ValueError(_RANKS_MSG.format(path=path, ranks=ranks))
        stack = quaxlike.quaxify(lambda *vs: jnp.stack(vs))
        out.append(
            MultiLoraArray._from_fields(
                w=leaf.w,
                a=stack(*(x.a for x in column)),
                b=stack(*(x.b for x in column)),
                allow_materialise=leaf.allow_materialise,
                stop_gradient=leaf.stop_gradient,
            )
        )
    return jtu.tree_unflatten(treedef, out)


def multi_loraify(
    model: PyTree, *, count: int, rank: int, key: PRNGKeyArray, **options: Any
) -> PyTree:
    """`count` fresh LoRA adapters over one base, stacked: `stack_adapters` of
    `loraify(model, rank=rank, key=k, **options)` for `count` keys split from `key`.

    **Arguments:**

    - `model`: the base model.
    - `count`: how many adapters.
    - `rank`, `key`: as for `loraify`.
    - `**options`: passed to `loraify` (`where`, `scale`, ...).

    **Returns:**

    The model with `MultiLoraArray`s; train it with `partition` (the factors of
    every adapter), serve it with `with_adapter`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(3, 2, 4, depth=1, key=jr.key(0))
        bank = multi_loraify(mlp, count=2, rank=1, key=jr.key(1), scale=0.1)
        ids, xs = jnp.array([1, 0, 1]), jnp.ones((3, 3))
        serve = lambda k, x: quaxlike.quaxify(with_adapter(bank, k))(x)
        ys = jax.vmap(serve)(ids, xs)
        assert jnp.allclose(ys[0], quaxlike.quaxify(with_adapter(bank, 1))(xs[0]), atol=1e-6)
        ```
    """
    keys = jr.split(key, count)
    return stack_adapters([loraify(model, rank=rank, key=k, **options) for k in keys])


def with_adapter(model: PyTree, k: ArrayLike) -> PyTree:
    """The model with adapter `k` of every `MultiLoraArray`: an ordinary LoRA model
    over the shared base.

    **Arguments:**

    - `model`: a PyTree holding `MultiLoraArray`s (from `stack_adapters`).
    - `k`: which adapter, an integer (concrete, or traced: under `jax.vmap` over
        requests, each request picks its own, as in
        `jax.vmap(lambda k, x: quaxify(with_adapter(model, k))(x))(ids, xs)`).

    **Returns:**

    The same PyTree with each `MultiLoraArray` replaced by its adapter `k`, a
    `LoraArray` whose frozen weight is the shared `W` (no copy).

    !!! example

        ```python
        base = eqx.nn.Linear(4, 3, key=jr.key(0))
        bank = multi_loraify(base, count=2, rank=1, key=jr.key(1), scale=0.1)
        one = with_adapter(bank, 1)
        assert one.weight.w is bank.weight.w and one.weight.a.shape == (3, 1)
        ```
    """
    is_multi = lambda x: isinstance(x, MultiLoraArray)  # noqa: E731
    return jtu.tree_map(lambda x: x.adapter(k) if is_multi(x) else x, model, is_leaf=is_multi)


def adapter_count(model: PyTree) -> int:
    """How many adapters the `MultiLoraArray`s of `model` hold (0 if none).

    **Arguments:**

    - `model`: any PyTree, such as the output of `multi_loraify`.

    **Returns:**

    The adapters' count, shared by every `MultiLoraArray` of the model (a model
    whose stacks hold different counts raises `ValueError`).

    !!! example

        ```python
        base = eqx.nn.Linear(3, 2, key=jr.key(0))
        assert adapter_count(multi_loraify(base, count=3, rank=1, key=jr.key(1))) == 3
        assert adapter_count(base) == 0
        ```
    """
    counts = {
        x.count for x in jtu.tree_leaves(model, is_leaf=_is_lora) if isinstance(x, MultiLoraArray)
    }
    if len(counts) > 1:
        raise ValueError(f"The model's MultiLoraArrays hold different counts: {sorted(counts)}.")
    return counts.pop() if counts else 0
