"""`PRNGKeyValue`: the same draws as plain `jax.random` on the wrapped key (typed
and raw uint32 keys), under jit/vmap/grad and inside scan/cond/while, and refusal
of arithmetic.

Keys are made once at module level: every `jax.random.split` compiles, and these
tests should stay quick.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.prng import (
    fold_in,
    KeyArithmeticError,
    normal,
    PRNGKeyValue,
    split,
    uniform,
)


KEY = jax.random.key(0)
RAW = jax.random.key_data(KEY)  # the legacy uint32[2] form of the same key
KEYS = jax.random.split(KEY, 4)


def data(key):
    """Key data of a typed key; raw key data unchanged."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def same_key(value, plain) -> bool:
    """Whether a PRNGKeyValue holds the same key as `plain` (a typed key, or raw
    key data)."""
    assert isinstance(value, PRNGKeyValue), type(value)
    return tree_allclose(data(value.key), data(plain))


def both(fn, *args, static_argnums=()):
    """`fn` quaxified on `args` (Values among them) and plainly on the keys they
    wrap, compiled as one program: one compilation per test instead of two."""

    def plain(x):
        if isinstance(x, PRNGKeyValue):
            return x.materialise()
        return x

    def run(*args):
        plain_args = jax.tree.map(plain, args, is_leaf=lambda x: isinstance(x, PRNGKeyValue))
        return quaxlike.quaxify(fn)(*args), fn(*plain_args)

    return jax.jit(run, static_argnums=static_argnums)(*args)


def draws(key):
    """A bit of everything `jax.random` does with a key."""
    key, sub = jax.random.split(key)
    a, b, c = jax.random.split(sub, 3)  # iterating: slice + squeeze
    return key, {
        "normal": jax.random.normal(a, (3,)),
        "uniform": jax.random.uniform(b, (2,), minval=-1.0, maxval=2.0),
        "fold_in": jax.random.bits(jax.random.fold_in(c, 7), (2,)),
        "permutation": jax.random.permutation(c, 5),
    }


def legacy_draws(key):
    key, sub = jax.random.split(key)
    return key, jax.random.normal(jax.random.fold_in(sub, 3), (3,))


def test_same_draws_as_plain_jax():
    typed, raw = PRNGKeyValue(KEY), PRNGKeyValue(RAW)
    assert not typed.raw and raw.raw

    def f(typed, raw):
        return draws(typed), legacy_draws(raw)

    ((key, got), (raw_key, raw_got)), ((plain_key, expected), (plain_raw_key, raw_expected)) = both(
        f, typed, raw
    )
    assert tree_allclose(got, expected) and tree_allclose(raw_got, raw_expected)
    assert not key.raw and same_key(key, plain_key)
    # Plain JAX hands the legacy key back as uint32 data; so does the raw Value.
    assert raw_key.raw and same_key(raw_key, plain_raw_key)
    assert tree_allclose(raw_key.materialise(), plain_raw_key)


def eqns_named(jaxpr, name):
    """The equations of primitive `name` in `jaxpr` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            found.extend(eqns_named(sub, name))
    return found


def test_gamma_binds_the_same_primitive():
    # `random_gamma` takes the key itself rather than bits. Compiling gamma's
    # sampler is slow, so compare the programs rather than the draws: the same
    # `random_gamma` equation on the typed key (quaxify may fold the constant 2.0).
    def fn(key):
        return jax.random.gamma(key, 2.0, (2,))

    (got,) = eqns_named(
        jax.make_jaxpr(quaxlike.quaxify(fn))(PRNGKeyValue(KEY)).jaxpr, "random_gamma"
    )
    (expected,) = eqns_named(jax.make_jaxpr(fn)(KEY).jaxpr, "random_gamma")
    assert got.params == expected.params
    assert [v.aval for v in got.invars] == [v.aval for v in expected.invars]
    assert str(got.invars[0].aval) == "key<fry>[]"


def test_avals_and_materialise():
    typed, raw = PRNGKeyValue(KEYS), PRNGKeyValue(jax.random.key_data(KEYS))
    assert typed.aval() == jax.typeof(KEYS)
    assert raw.aval().str_short() == "uint32[4,2]" and raw.shape == (4, 2)
    assert raw.key.shape == (4,) and raw.impl == "threefry2x32"
    assert typed.materialise() is KEYS
    assert tree_allclose(raw.materialise(), jax.random.key_data(KEYS))
    assert PRNGKeyValue(KEY, raw=True).aval().str_short() == "uint32[2]"


def test_constructor_refuses_numbers():
    # (Under the suite's runtime type checker a float array still passes the
    # `ArrayLike` annotation, so this is PRNGKeyValue's own message.)
    with pytest.raises(TypeError, match="typed key array .* got an array of dtype float32"):
        PRNGKeyValue(jnp.zeros(2, jnp.float32))


def test_public_functions():
    def f(value, raw):
        # Outside `quaxify` (here under `jax.jit`), on Values and on a plain key.
        return (
            split(value, 4),
            fold_in(value, 3),
            normal(value, (3,)),
            uniform(value, (2,)),
            split(raw, 4),
            normal(KEY, (3,)),
        )

    def reference():
        return (
            KEYS,
            jax.random.fold_in(KEY, 3),
            jax.random.normal(KEY, (3,)),
            jax.random.uniform(KEY, (2,)),
            jax.random.key_data(KEYS),
            jax.random.normal(KEY, (3,)),
        )

    (keys, folded, x, u, raw_keys, plain_x), expected = jax.jit(
        lambda v, r: (f(v, r), reference())
    )(PRNGKeyValue(KEY), PRNGKeyValue(RAW))
    assert isinstance(keys, PRNGKeyValue) and keys.shape == (4,) and same_key(keys, expected[0])
    assert same_key(folded, expected[1])
    assert tree_allclose((x, u), expected[2:4])
    assert raw_keys.raw and raw_keys.shape == (4, 2) and same_key(raw_keys, expected[4])
    assert tree_allclose(plain_x, expected[5])


def test_structural_operations_keep_keys():
    def f(keys):
        first, second, *_ = keys  # iteration: slice + squeeze
        return {
            "index": keys[2],
            "slice": keys[1:3],
            "reverse": keys[::-1],
            "gather": keys[jnp.array([3, 0])],
            "dynamic": keys[jnp.int32(1)],
            "reshape": keys.reshape(2, 2),
            "stack": jnp.stack([first, second]),
            "concatenate": jnp.concatenate([keys, keys]),
            # `tile` and `unstack` are primitives in recent JAX.
            "tile": jnp.tile(keys, 2),
            "unstack": jnp.unstack(keys.reshape(2, 2), axis=1),
            "where": jnp.where(True, first, second),
            "expand": keys[None],
            "update": keys.at[0].set(second),
        }

    def g(keys):
        first, second, *_ = keys
        return {
            "index": keys[2],
            "reshape": keys.reshape(2, 2, 2),
            "stack": jnp.stack([first, second]),
            "where": jnp.where(True, first, second),
            # No longer of key shape: plain uint32 numbers.
            "word": keys[:, 0],
        }

    (got, raw_got), (expected, raw_expected) = both(
        lambda k, r: (f(k), g(r)), PRNGKeyValue(KEYS), PRNGKeyValue(jax.random.key_data(KEYS))
    )
    for name in expected:
        for got_key, expected_key in zip(
            jax.tree.leaves(got[name], is_leaf=lambda x: isinstance(x, PRNGKeyValue)),
            jax.tree.leaves(expected[name]),
        ):
            assert isinstance(got_key, PRNGKeyValue) and not got_key.raw, name
            assert same_key(got_key, expected_key), name
    for name in raw_expected:
        if name == "word":
            assert not isinstance(raw_got[name], PRNGKeyValue)
            assert tree_allclose(raw_got[name], raw_expected[name])
        else:
            assert isinstance(raw_got[name], PRNGKeyValue) and raw_got[name].raw, name
            assert tree_allclose(raw_got[name].materialise(), raw_expected[name]), name


def test_jit_keeps_raw_keys_free_of_wrap_and_unwrap():
    # Legacy `split` on uint32 data is wrap -> split -> unwrap. A raw PRNGKeyValue
    # holds the typed key already, so only the split itself remains.
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda k: jax.random.split(k, 3)))(PRNGKeyValue(RAW))
    assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["random_split"]
    plain = jax.make_jaxpr(lambda k: jax.random.split(k, 3))(RAW)
    assert [eqn.primitive.name for eqn in plain.eqns] == [
        "random_wrap",
        "random_split",
        "random_unwrap",
    ]


def test_key_data_and_wrap_key_data_only_change_the_presentation():
    def f(key):
        data = jax.random.key_data(key)
        return data, jax.random.wrap_key_data(data), key == jax.random.wrap_key_data(data)

    closed = jax.make_jaxpr(quaxlike.quaxify(f))(PRNGKeyValue(KEY))
    # Neither `random_unwrap` nor `random_wrap` remains: only the comparison.
    assert [eqn.primitive.name for eqn in closed.eqns] == ["eq"]
    data, key, equal = quaxlike.quaxify(f)(PRNGKeyValue(KEY))
    # Inside `quaxify`, key data is still a key (presented raw), not numbers.
    assert isinstance(data, PRNGKeyValue) and data.raw and same_key(data, KEY)
    assert isinstance(key, PRNGKeyValue) and not key.raw and same_key(key, KEY)
    assert not isinstance(equal, PRNGKeyValue) and bool(equal)


def test_vmap_over_a_batch_of_keys():
    def f(key):
        key, sub = jax.random.split(key)
        return key, jax.random.normal(sub, (2,))

    def run(typed, raw):
        return jax.vmap(f)(typed), jax.vmap(f)(raw)

    # `jax.vmap` applied outside `quaxify`, over a batch of Values.
    def quaxified(typed, raw):
        fn = jax.vmap(quaxlike.quaxify(f))
        return fn(typed), fn(raw)

    values = PRNGKeyValue(KEYS), PRNGKeyValue(jax.random.key_data(KEYS))
    got, expected = jax.jit(lambda v, p: (quaxified(*v), run(*p)))(
        values, (KEYS, jax.random.key_data(KEYS))
    )
    for (keys, x), (plain_keys, plain_x), raw in zip(got, expected, [False, True]):
        assert tree_allclose(x, plain_x) and x.shape == (4, 2)
        assert keys.raw is raw and keys.shape == plain_keys.shape
        assert same_key(keys, plain_keys)


def test_vmap_inside_quaxify():
    def f(keys):
        return jax.vmap(lambda k: jax.random.uniform(k, (3,)))(keys)

    got, expected = both(f, PRNGKeyValue(KEYS))
    assert tree_allclose(got, expected)


def test_grad_with_noise_from_a_key_value(getseed):
    x = randn(getseed(), (3,))

    def loss(x, key):
        noise = jax.random.normal(key, x.shape)
        return jnp.sum(jnp.sin(x) * noise)

    got, expected = jax.jit(
        lambda x, v, k: (jax.grad(quaxlike.quaxify(loss))(x, v), jax.grad(loss)(x, k))
    )(x, PRNGKeyValue(KEY), KEY)
    assert tree_allclose(got, expected)
    assert not np.allclose(got, 0.0)


def noise_walk(key, steps):
    def step(key, _):
        key, sub = jax.random.split(key)
        return key, jax.random.normal(sub, (2,))

    return lax.scan(step, key, length=steps)


def test_scan_splitting_a_key_carry():
    def f(typed, raw):
        return noise_walk(typed, 4), noise_walk(raw, 4)

    got, expected = both(f, PRNGKeyValue(KEY), PRNGKeyValue(RAW))
    for (key, noise), (plain_key, plain_noise), raw in zip(got, expected, [False, True]):
        assert tree_allclose(noise, plain_noise) and noise.shape == (4, 2)
        assert isinstance(key, PRNGKeyValue) and key.raw is raw
        assert same_key(key, plain_key)


def test_scan_over_keys_and_returning_keys():
    def f(keys):
        def step(total, key):
            return total + jax.random.uniform(key), jax.random.fold_in(key, 1)

        return lax.scan(step, 0.0, keys)

    (total, folded), (plain_total, plain_folded) = both(f, PRNGKeyValue(KEYS))
    assert tree_allclose(total, plain_total)
    assert same_key(folded, plain_folded) and folded.shape == (4,)


def test_cond_and_while_with_key_carries():
    def f(key):
        key = lax.cond(
            jax.random.uniform(key) > 0.5,
            lambda k: jax.random.split(k)[0],
            lambda k: jax.random.fold_in(k, 1),
            key,
        )

        def body(carry):
            i, key, total = carry
            key, sub = jax.random.split(key)
            return i + 1, key, total + jax.random.uniform(sub)

        return lax.while_loop(lambda c: c[2] < 2.0, body, (0, key, 0.0))

    (count, key, total), (plain_count, plain_key, plain_total) = both(f, PRNGKeyValue(KEY))
    assert int(count) == int(plain_count) and int(count) > 1
    assert tree_allclose(total, plain_total)
    assert same_key(key, plain_key)


# --- arithmetic is refused -------------------------------------------------------


@pytest.mark.parametrize(
    "fn, primitive",
    [
        (lambda k: lax.add(k, k), "add"),
        (lambda k: lax.mul(k, k), "mul"),
        (lambda k: lax.neg(k), "neg"),
        (lambda k: lax.reduce_max(k, (0,)), "reduce_max"),
    ],
)
def test_arithmetic_on_typed_keys_is_refused(fn, primitive):
    with pytest.raises(KeyArithmeticError, match=f"`{primitive}` was applied to a PRNG key"):
        jax.jit(quaxlike.quaxify(fn))(PRNGKeyValue(KEYS))


def test_jnp_arithmetic_on_typed_keys_is_refused_by_jax():
    # `jnp` checks dtypes before binding any primitive, so JAX's own error comes first.
    with pytest.raises(TypeError, match="add does not accept dtypes key<fry>"):
        jax.jit(quaxlike.quaxify(lambda k: k + 1))(PRNGKeyValue(KEY))


@pytest.mark.parametrize(
    "fn, primitive",
    [
        (lambda k: k + 1, "add"),
        (lambda k: k * 2, "mul"),
        (lambda k: -k, "neg"),
        (lambda k: k ^ 1, "xor"),
        (lambda k: k >> 1, "shift_right_logical"),
        (lambda k: jnp.sum(k), "reduce_sum"),
        (lambda k: k.astype(jnp.float32), "convert_element_type"),
        (lambda k: jax.random.split(k + 1), "add"),
    ],
)
def test_arithmetic_on_raw_keys_is_refused(fn, primitive):
    # Plain JAX computes all of these on uint32 key data without complaint.
    jax.eval_shape(fn, RAW)
    with pytest.raises(KeyArithmeticError, match=rf"`{primitive}` was applied to a PRNG key"):
        jax.jit(quaxlike.quaxify(fn))(PRNGKeyValue(RAW))


def test_error_message_teaches():
    with pytest.raises(KeyArithmeticError) as info:
        jax.jit(quaxlike.quaxify(lambda k: k + 1))(PRNGKeyValue(RAW))
    message = str(info.value)
    assert "presented as uint32[2]" in message and "argument 0" in message
    assert "PRNG keys are not numbers" in message
    assert "jax.random.split" in message and "jax.random.fold_in" in message


def test_mixing_typed_and_raw_keys_is_refused():
    with pytest.raises(KeyArithmeticError, match="both as typed keys and as raw"):
        jax.jit(quaxlike.quaxify(lambda a, b: lax.concatenate([a[None], b[None]], 0)))(
            PRNGKeyValue(KEY), PRNGKeyValue(KEY, raw=True)
        )


def test_readme_example(capsys):
    """The README's example runs as written."""
    readme = pathlib.Path(quaxlike.__file__).parent / "prng" / "README.md"
    (code,) = re.findall(r"## Example\n\n```python\n(.*?)```", readme.read_text(), re.S)
    exec(compile(code, str(readme), "exec"), {})
    printed = capsys.readouterr().out
    assert "PRNGKeyValue (5, 2)" in printed and "True (2,)" in printed and "(4, 3)" in printed
    assert "`add` was applied to a PRNG key" in printed
