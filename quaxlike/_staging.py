"""Programs traced once and reused: a function of Values and arrays run as a
`jax.jit` over the array leaves of its arguments, for the `jit` rule's compiled
bodies and for rules marked with `cached_rule`."""

import functools as ft
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _instrument, _jax_compat as jc, _policy
from ._rules import rules_generation


_Rule = TypeVar("_Rule", bound=Callable[..., Any])


# Whether a leaf counts as an array depends on its type alone (`eqx.is_array`
# is an `isinstance` check, about half a microsecond against the `jax.Array`
# ABC): remembered per predicate, per type.
_array_types: dict[Callable, dict[type, bool]] = {}


def split_arrays(
    tree, is_array: Callable[[Any], bool] = eqx.is_array
) -> tuple[list, tuple, Any, tuple]:
    """The array leaves of `tree`, their positions among all its leaves, its
    structure, and its other leaves (`None` where an array was): what crosses a
    JAX transformation, and what is closed over. `join_arrays` undoes it.
    `is_array` says which leaves count as arrays; its answer must depend on the
    leaf's type only."""
    leaves, treedef = jtu.tree_flatten(tree)
    known = _array_types.get(is_array)
    if known is None:
        known = _array_types[is_array] = {}
    arrays, positions = [], []
    for i, leaf in enumerate(leaves):
        answer = known.get(type(leaf))
        if answer is None:
            answer = known[type(leaf)] = is_array(leaf)
        if answer:
            arrays.append(leaf)
            positions.append(i)
            leaves[i] = None
    return arrays, tuple(positions), treedef, tuple(leaves)


def join_arrays(arrays, positions, treedef, others):
    """The tree `split_arrays` took apart, with `arrays` as its array leaves."""
    leaves = list(others)
    for i, array in zip(positions, arrays):
        leaves[i] = array
    return jtu.tree_unflatten(treedef, leaves)


def _aval_key(x) -> Any:
    # What `jax.typeof(x)` says, as a key: a concrete array carries its aval
    # (without the sharding, which `typeof` folds in) and its sharding as plain
    # attributes, which is a tenth of the cost.
    if type(x) is jc.ArrayImpl:
        return x.aval, x.sharding
    return jax.typeof(x)


def staging_key(arrays, positions, treedef, others) -> tuple:
    """What a staged call's program depends on besides its params: the
    arguments' structure and non-array leaves, the avals of their array
    leaves, the registered rules (their generation) and checked mode. May hold
    unhashable leaves: hash it before use. Raises `TypeError` or
    `OverflowError` for an array leaf JAX cannot represent (a Python int too
    large), as `jax.typeof` does."""
    return (
        treedef,
        positions,
        others,
        tuple(map(_aval_key, arrays)),
        rules_generation(),
        _instrument.checking.get(),
    )


class StagedCall:
    """`fn(*args)` as one `jax.jit` over the array leaves of `args`, for one
    structure and set of non-array leaves of the arguments (`split_arrays`).

    Its owner keys it on the avals of the array leaves too, so it is traced
    once and the structure of its output, recorded then, never changes.
    """

    def __init__(self, fn: Callable, name: str, positions, treedef, others, *, inline=False):
        self.out_structure: list = []

        def run(*arrays):
            out = fn(*join_arrays(arrays, positions, treedef, others))
            out_arrays, *self.out_structure = split_arrays(out)
            return out_arrays

        run.__name__ = run.__qualname__ = name
        self.jitted = jax.jit(run, inline=inline)

    def __call__(self, arrays):
        return join_arrays(self.jitted(*arrays), *self.out_structure)


# Staged calls per cached rule are dropped all at once past this many (a rule
# applied to ever new shapes must not grow without bound).
_MAX_CACHED_PER_RULE = 1024


def cached_rule(rule: _Rule) -> _Rule:
    """Trace a rule once per argument types and reuse the program it recorded.

    Put it under `quaxlike.register`. The first call for some argument
    structure (Value types and their non-array fields), array avals and params
    runs `rule` inside a `jax.jit(..., inline=True)`; later calls like it hand
    JAX that cached program, which JAX copies into the enclosing program
    without running the rule's Python again, exactly as it does for
    `jax.numpy` functions. Worth it for rules that emit several equations
    (LoRA's product emits four); the equations are the same either way.

    Only for rules whose result depends on nothing but those: no Python side
    effects, no reading global state, no concrete values. Under a "warn" or
    "error" `materialise_policy`, under `quaxlike.explain`, and when the
    params are not hashable, the rule simply runs, so that every fallback is
    still reported and recorded.

    **Arguments:**

    - `rule`: the rule, as it would be passed to `quaxlike.register`.

    **Returns:**

    The rule with caching, with `rule`'s name, signature and annotations (so
    `register` dispatches on them).

    !!! example

        ```python
        class Scaled(quaxlike.ArrayValue):  # stands for scale * array
            array: jax.Array
            scale: float = eqx.field(static=True)

            def aval(self):
                return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

            def materialise(self):
                return self.scale * self.array

        @quaxlike.register(jax.lax.dot_general_p)
        @quaxlike.internal.cached_rule
        def _(x: Scaled, y: jax.Array, *, dimension_numbers, **params):
            product = quaxlike.internal.bind_dot_general(x.array, y, dimension_numbers, params)
            return x.scale * product

        w, v = jnp.ones((3, 2)), jnp.ones(2)
        f = quaxlike.quaxify(lambda w, v: w @ v)
        assert jnp.allclose(f(Scaled(w, 2.0), v), 2 * (w @ v))
        assert jnp.allclose(f(Scaled(w, 3.0), v), 3 * (w @ v))  # another program
        ```
    """
    calls: dict[tuple, StagedCall] = {}
    name = getattr(rule, "__name__", "rule")

    @ft.wraps(rule)
    def run_cached(*args, **params):
        if _policy.current_mode() != "allow" or _instrument.recorder.get() is not None:
            return rule(*args, **params)
        arrays, positions, treedef, others = split_arrays(args)
        key = (
            tuple(sorted(params.items())),
            *staging_key(arrays, positions, treedef, others),
        )
        try:
            call = calls.get(key)
        except TypeError:  # a non-array leaf or a param that cannot be hashed
            return rule(*args, **params)
        if call is None:
            if len(calls) >= _MAX_CACHED_PER_RULE:
                calls.clear()
            call = calls[key] = StagedCall(
                ft.partial(_call_rule, rule, params), name, positions, treedef, others, inline=True
            )
        return call(arrays)

    return run_cached  # pyright: ignore


def _call_rule(rule, params, *args):
    return rule(*args, **params)
