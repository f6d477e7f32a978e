"""`cached_rule`: a rule traced once per argument types, its program reused."""

import functools as ft
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _jax_compat as jc
from .._staging import CompiledCalls, shortcuts_apply, split_arrays, StagedCall


_Rule = TypeVar("_Rule", bound=Callable[..., Any])


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
    calls = CompiledCalls()
    name = getattr(rule, "__name__", "rule")

    @ft.wraps(rule)
    def run_cached(*args, **params):
        if shortcuts_apply():
            split = split_arrays(args)
            key = (tuple(sorted(params.items())), *split.key())
            call = calls.get(
                key,
                lambda: StagedCall(
                    ft.partial(_call_rule, rule, params), name, split, inline=jc.JIT_INLINE_AT_TRACE
                ),
            )
            if call is not None:
                return call(split.arrays)
        return rule(*args, **params)

    run_cached.compiled_calls = calls  # pyright: ignore[reportAttributeAccessIssue]  (docs/caches.md)
    return run_cached  # pyright: ignore


def _call_rule(rule, params, *args):
    return rule(*args, **params)
