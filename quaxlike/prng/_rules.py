"""Rules for `PRNGKeyValue`: the primitives that are safe on keys.

At primitive level a typed key is an array of dtype `key<impl>`:
`jax.random.split` is `random_split`, `fold_in` is `random_fold_in`, every draw
starts from `random_bits` (inside a `jit` such as `_uniform`), and legacy uint32
keys go through `random_wrap` on the way in and `random_unwrap` on the way out.
Structural primitives (indexing, reshaping, stacking, selecting) also accept key
arrays. Everything else reaches `PRNGKeyValue.default`, which refuses.
"""

from typing import Any

import jax
import jax.extend.core
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._value import is_typed_key, key_data_struct, KeyArithmeticError, PRNGKeyValue, with_key


def _primitive_of(fn, *example_args) -> jax.extend.core.Primitive:
    # `random_wrap`, `random_unwrap` and `random_clone` are not exported by any
    # public JAX module; find them as the only equation `fn` traces to (abstractly:
    # nothing runs at import).
    (eqn,) = jax.make_jaxpr(fn)(*example_args).eqns
    return eqn.primitive


_example_key = jax.eval_shape(jax.random.key, 0)
random_wrap_p = _primitive_of(jax.random.wrap_key_data, key_data_struct(_example_key.dtype))
random_unwrap_p = _primitive_of(jax.random.key_data, _example_key)
random_clone_p = _primitive_of(jax.random.clone, _example_key)
del _example_key

_MIXED_MSG = (
    "`{primitive}` got PRNG keys presented both as typed keys and as raw uint32 key "
    "data. Present them the same way: build every PRNGKeyValue from `jax.random.key` "
    "(typed) or every one from `jax.random.PRNGKey` (raw), or pass `raw=` explicitly."
)


def _presentation(primitive, args) -> bool:
    """Whether the keys among `args` are presented as raw key data."""
    modes = {a.raw for a in args if isinstance(a, PRNGKeyValue)}
    if len(modes) > 1:
        raise KeyArithmeticError(_MIXED_MSG.format(primitive=primitive.name))
    return modes.pop()


def _presented(x: Any) -> Any:
    """What JAX code sees of `x`: the typed key, or its raw data."""
    if isinstance(x, PRNGKeyValue):
        return jax.random.key_data(x.key) if x.raw else x.key
    return x


def _looks_like_key_data(out: Any, key_dtype) -> bool:
    data = key_data_struct(key_dtype)
    n = len(data.shape)
    return out.dtype == data.dtype and out.ndim >= n and out.shape[out.ndim - n :] == data.shape


def _rewrap(out: Any, raw: bool, like: PRNGKeyValue) -> Any:
    """Turn a structural primitive's output back into a PRNGKeyValue where it is
    still a key: a typed key array, or (for raw keys) uint32 data of key shape.
    It has the class of `like` (a `ThreeFry` stays one)."""
    if is_typed_key(out):
        return with_key(like, out, raw)
    if raw and _looks_like_key_data(out, like.key.dtype):
        return with_key(like, jax.random.wrap_key_data(out, impl=like.impl), True)
    return out


def _rule_name(primitive) -> str:
    return f"{primitive.name.replace('-', '_')}_p_prngkeyvalue"


# --- structural primitives: keys in, keys out ------------------------------------

_STRUCTURAL = [
    lax.slice_p,
    lax.squeeze_p,
    lax.reshape_p,
    lax.broadcast_in_dim_p,
    lax.concatenate_p,
    lax.dynamic_slice_p,
    lax.dynamic_update_slice_p,
    lax.gather_p,
    lax.scatter_p,
    lax.select_n_p,
    lax.rev_p,
    lax.transpose_p,
    lax.copy_p,
    lax.eq_p,
    lax.ne_p,
    lax.split_p,
    lax.optimization_barrier_p,
]
# `stack`, `unstack` (JAX 0.10.1 and later) and `tile` (0.9 and later) are
# primitives in recent JAX: `jnp.stack`, `jnp.unstack` and `jnp.tile` of keys.
_STRUCTURAL += [
    getattr(lax, name) for name in ("stack_p", "unstack_p", "tile_p") if hasattr(lax, name)
]


def _make_structural_rule(primitive):
    def rule(*args: PRNGKeyValue | ArrayLike, **params):
        raw = _presentation(primitive, args)
        like = next(a for a in args if isinstance(a, PRNGKeyValue))
        out = primitive.bind(*map(_presented, args), **params)
        if primitive.multiple_results:
            return [_rewrap(o, raw, like) for o in out]
        return _rewrap(out, raw, like)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive)
    return rule


for _primitive in _STRUCTURAL:
    quaxlike.register(_primitive)(_make_structural_rule(_primitive))


# --- random primitives -----------------------------------------------------------


@quaxlike.register(jax.extend.core.primitives.random_split_p)
def random_split_p_prngkeyvalue(key: PRNGKeyValue, **params) -> PRNGKeyValue:
    out = jax.extend.core.primitives.random_split_p.bind(_presented(key), **params)
    return with_key(key, out, False)


@quaxlike.register(jax.extend.core.primitives.random_fold_in_p)
def random_fold_in_p_prngkeyvalue(key: PRNGKeyValue, msgs: ArrayLike, **params) -> PRNGKeyValue:
    out = jax.extend.core.primitives.random_fold_in_p.bind(_presented(key), msgs, **params)
    return with_key(key, out, False)


@quaxlike.register(random_clone_p)
def random_clone_p_prngkeyvalue(key: PRNGKeyValue, **params) -> PRNGKeyValue:
    return with_key(key, random_clone_p.bind(_presented(key), **params), False)


# Draws: the numbers are ordinary arrays.
@quaxlike.register(jax.extend.core.primitives.random_bits_p)
def random_bits_p_prngkeyvalue(key: PRNGKeyValue, **params) -> Any:
    return jax.extend.core.primitives.random_bits_p.bind(_presented(key), **params)


@quaxlike.register(jax.extend.core.primitives.random_gamma_p)
def random_gamma_p_prngkeyvalue(key: PRNGKeyValue, a: ArrayLike, **params) -> Any:
    return jax.extend.core.primitives.random_gamma_p.bind(_presented(key), a, **params)


# Legacy uint32 keys: `jax.random.split(raw_key)` is `random_wrap`, then
# `random_split`, then `random_unwrap`. A PRNGKeyValue already holds the typed key,
# so wrapping and unwrapping only change how it is presented, and cost nothing.
@quaxlike.register(random_wrap_p)
def random_wrap_p_prngkeyvalue(data: PRNGKeyValue, *, impl, **params) -> PRNGKeyValue:
    if data.raw and getattr(impl, "name", impl) == data.impl:
        return with_key(data, data.key, False)
    # Typed keys (which JAX rejects here) or data reinterpreted under another impl.
    return with_key(data, random_wrap_p.bind(_presented(data), impl=impl, **params), False)


@quaxlike.register(random_unwrap_p)
def random_unwrap_p_prngkeyvalue(key: PRNGKeyValue, **params) -> Any:
    if not key.raw:
        return with_key(key, key.key, True)
    return random_unwrap_p.bind(_presented(key), **params)  # JAX rejects this
