"""`quaxlike.lora`: LoraArray's rules, compared with plain JAX on the dense
`W + A @ B`, under jit/grad/vmap and control flow; `loraify`, `partition`, `merge`;
and an optax training loop.

LoraArrays here are built with `allow_materialise=False` (the default) unless a test
says otherwise, so any fallback to a dense array raises. The traced programs are also
searched for a `dot_general` producing an `(m, n)` block, which building `A @ B`
would need.

Speed: tracing through quaxify and compiling dominate, so the case tables below are
each run as one jitted program (and their plain-JAX references as another), then
checked case by case.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax import lax

import quaxlike
from quaxlike.lora import LoraArray, loraify, merge, partition, trainable_filter
from quaxlike.symbolic.zero import Zero


RTOL, ATOL = 1e-4, 1e-5
_KEY = jr.key(0)
M, N, R = 7, 5, 2  # distinct sizes, so that an (M, N) block is recognisable in a jaxpr

# `jax.jit` without XLA's backend optimisations: these programs are tiny and run
# once, so compiling them is what costs time.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def randn(seed, shape, scale=1.0):
    # As helpers.randn, but made by NumPy and transferred: `jnp.asarray` compiles a
    # small program for every new shape.
    rng = np.random.default_rng(seed)
    return jax.device_put((scale * rng.standard_normal(shape)).astype(np.float32))


@functools.cache
def _template(**flags):
    return LoraArray(jnp.zeros((1, 1)), rank=1, key=_KEY, **flags)


def make_lora(seed, shape=(M, N), rank=R, scale=0.5, **flags):
    """A LoraArray whose `b` is non-zero, so that `A @ B` matters. (Built from a
    template: `LoraArray(...)` would compile a random draw for every new shape.)"""
    *batch, m, n = shape
    w = randn(seed, shape, scale)
    a = randn(seed + 1000, (*batch, m, rank), scale)
    b = randn(seed + 2000, (*batch, rank, n), scale)
    return _template(**flags).with_factors(w, a, b)


def is_lora(x):
    return isinstance(x, LoraArray)


def dense(x):
    """The plain array a LoraArray stands for (computed by hand, not by its rules)."""
    if is_lora(x):
        return x.w + jnp.einsum("...mr,...rn->...mn", x.a, x.b)
    return x


def dense_tree(tree):
    return jax.tree_util.tree_map(dense, tree, is_leaf=is_lora)


def loras(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_lora) if is_lora(x)]


def equations(jaxpr):
    """Every equation of a jaxpr, including those of nested jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from equations(sub)


def dense_products(fn, *args, m=M, n=N):
    """The `dot_general`s in `fn`'s program whose output holds an `(m, n)` block."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = []
    for eqn in equations(jaxpr):
        if eqn.primitive is lax.dot_general_p:
            shape = tuple(eqn.outvars[0].aval.shape)
            if any(shape[i : i + 2] == (m, n) for i in range(len(shape) - 1)):
                found.append(shape)
    return found


class CaseTable:
    """A table `name -> (function, inputs)` run as one quaxified, jitted program and
    compared with one plain-JAX program on the dense inputs."""

    def __init__(self, cases):
        self.fns = {name: fn for name, (fn, _) in cases.items()}
        self.inputs = {name: inputs for name, (_, inputs) in cases.items()}

    def program(self, inputs):
        return {name: fn(*inputs[name]) for name, fn in self.fns.items()}

    @functools.cached_property
    def _got(self):
        def run(inputs):
            out = quaxlike.quaxify(self.program)(inputs)
            return out, dense_tree(out)

        return jit(run)(self.inputs)

    @property
    def got(self):
        return self._got[0]

    @property
    def got_dense(self):
        """`got` with every LoraArray replaced by the array it stands for."""
        return self._got[1]

    @functools.cached_property
    def expected(self):
        return jit(lambda inputs: self.program(dense_tree(inputs)))(self.inputs)

    @functools.cached_property
    def dense_products(self):
        return dense_products(quaxlike.quaxify(self.program), self.inputs)


# --- construction and aval ------------------------------------------------------


def test_construction(getseed):
    w = randn(getseed(), (3, M, N))
    lora = LoraArray(w, rank=4, scale=0.5, key=_KEY)
    assert lora.shape == (3, M, N) and lora.dtype == jnp.float32 and lora.rank == 4
    assert lora.a.shape == (3, M, 4) and lora.b.shape == (3, 4, N)
    assert not np.any(np.asarray(lora.b)) and np.any(np.asarray(lora.a))
    assert lora.w is w
    # NumPy weights are accepted and converted.
    assert isinstance(LoraArray(np.ones((3, M, N), np.float32), rank=4, key=_KEY).w, jax.Array)


@pytest.mark.parametrize(
    "weight, rank, match",
    [
        (np.ones(3, np.float32), 1, "at least two dimensions"),
        (np.ones((3, 3), np.int32), 1, "floating-point"),
        (np.ones((3, 3), np.float32), 0, "positive integer `rank`"),
    ],
)
def test_construction_errors(weight, rank, match):
    with pytest.raises(ValueError, match=match):
        LoraArray(weight, rank=rank, key=_KEY)


def test_refuses_to_materialise(getseed):
    lora = make_lora(getseed())
    with pytest.raises(quaxlike.MaterialisationError, match="LoraArray") as info:
        quaxlike.quaxify(jnp.exp)(lora)
    assert "`exp`" in str(info.value) and "allow_materialise=True" in str(info.value)
    # Rounding to integers is not a rule: it needs the dense array too.
    with pytest.raises(quaxlike.MaterialisationError, match="convert_element_type"):
        quaxlike.quaxify(lambda m: m.astype(jnp.int32))(lora)
    allowed = make_lora(getseed(), allow_materialise=True)
    got, expected = jit(lambda m: (quaxlike.quaxify(jnp.exp)(m), jnp.exp(dense(m))))(allowed)
    assert tree_allclose(got, expected, rtol=RTOL)


def test_aval_adds_no_equations(getseed):
    lora = make_lora(getseed(), (3, M, N))
    seen = []

    def f(m):
        seen.append((m.shape, m.dtype, m.ndim, m.size))

    jaxpr = jax.make_jaxpr(quaxlike.quaxify(f))(lora)
    assert seen == [((3, M, N), jnp.float32, 3, 3 * M * N)]
    assert len(jaxpr.eqns) == 0


# --- dot_general ----------------------------------------------------------------

# name -> (lora shape, other shape, function of (lora, other)); `None` for the other
# shape means a second LoraArray. No output holds an (M, N) block.
DOT_CASES = {
    "matvec": ((M, N), (N,), lambda m, x: m @ x),
    "vecmat": ((M, N), (M,), lambda m, x: x @ m),
    "T_matvec": ((M, N), (M,), lambda m, x: m.T @ x),
    "matmul": ((M, N), (N, 3), lambda m, x: m @ x),
    "matmul_right": ((M, N), (3, M), lambda m, x: x @ m),
    "matmul_right_T": ((M, N), (3, N), lambda m, x: x @ m.T),
    "batched_matvec": ((4, M, N), (N,), lambda m, x: m @ x),
    "batched_both": ((4, M, N), (4, N, 3), lambda m, x: m @ x),
    "batched_right": ((4, M, N), (4, 3, M), lambda m, x: x @ m),
    "batch_contracted": ((4, M, N), (4, N), lambda m, x: jnp.einsum("bmn,bn->m", m, x)),
    "batch_free": ((4, M, N), (3, N), lambda m, x: jnp.einsum("bmn,pn->pbm", m, x)),
    "both_axes": ((M, N), (M, N), lambda m, x: jnp.einsum("mn,mn->", m, x)),
    "tensordot_m": ((M, N), (M, 2, 3), lambda m, x: jnp.tensordot(m, x, axes=([0], [0]))),
    "lora_lora": ((M, N), None, lambda m, k: m @ k.T),
    "lora_lora_batched": ((4, M, N), None, lambda m, k: jnp.einsum("bmn,bkn->bmk", m, k)),
}


def _dot_inputs(i, shape, other_shape):
    lora = make_lora(10 * i, shape)
    other = make_lora(10 * i + 1, shape) if other_shape is None else randn(10 * i + 1, other_shape)
    return lora, other


DOTS = CaseTable(
    {
        name: (fn, _dot_inputs(i, shape, other_shape))
        for i, (name, (shape, other_shape, fn)) in enumerate(DOT_CASES.items())
    }
)


@pytest.mark.parametrize("case", list(DOT_CASES))
def test_dot_general(case):
    assert tree_allclose(DOTS.got[case], DOTS.expected[case], rtol=RTOL, atol=ATOL)


def test_dot_general_builds_no_dense_block():
    assert DOTS.dense_products == []


def test_dense_block_check_can_fail(getseed):
    # The check above sees a materialised LoRA (here, for `exp`, which has no rule).
    lora = make_lora(getseed(), allow_materialise=True)
    x = randn(getseed(), (N,))
    assert dense_products(quaxlike.quaxify(lambda m, x: jnp.exp(m) @ x), lora, x) == [(M, N)]


def test_dot_general_grads(getseed):
    # Gradients with respect to both factors and the dense operand, for a few cases.
    cases = ["matmul_right_T", "batched_both", "batch_free", "lora_lora"]

    def total(factors, others, quaxified):
        out = 0.0
        for case in cases:
            lora, _ = DOTS.inputs[case]
            lora = lora.with_factors(lora.w, *factors[case])
            other = others[case]
            if quaxified:
                out = out + jnp.sum(jnp.sin(quaxlike.quaxify(DOTS.fns[case])(lora, other)))
            else:
                out = out + jnp.sum(jnp.sin(DOTS.fns[case](dense(lora), dense(other))))
        return out

    factors = {case: (DOTS.inputs[case][0].a, DOTS.inputs[case][0].b) for case in cases}
    others = {case: DOTS.inputs[case][1] for case in cases}
    # The second LoraArray of "lora_lora" is differentiated with respect to all its
    # leaves; its `w` is frozen, so its gradient must be zero in both programs.
    grad = jax.grad(total, argnums=(0, 1))
    got, expected = jit(lambda f, o: (grad(f, o, True), grad(f, o, False)))(factors, others)
    assert tree_allclose(got[0], expected[0], rtol=RTOL, atol=ATOL)
    got_lora, expected_lora = got[1].pop("lora_lora"), expected[1].pop("lora_lora")
    assert tree_allclose(got[1], expected[1], rtol=RTOL, atol=ATOL)
    assert tree_allclose((got_lora.a, got_lora.b), (expected_lora.a, expected_lora.b), rtol=RTOL)
    assert not np.any(np.asarray(got_lora.w))


def test_dot_general_precision_and_dtype(getseed):
    lora = make_lora(getseed())
    x = randn(getseed(), (N,)).astype(jnp.bfloat16)

    def f(m, x):
        m = m.astype(jnp.bfloat16)
        return m, lax.dot(m, x, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    (lora16, out), (dense16, expected) = jit(
        lambda m, x: (quaxlike.quaxify(f)(m, x), f(dense(m), x))
    )(lora, x)
    assert isinstance(lora16, LoraArray) and lora16.dtype == jnp.bfloat16
    assert out.dtype == jnp.float32
    assert tree_allclose(out, expected, rtol=3e-2, atol=3e-2)


def test_stop_gradient_flag(getseed):
    x, seed = randn(getseed(), (N,)), getseed()
    frozen, free = make_lora(seed), make_lora(seed, stop_gradient=False)

    def loss(m):
        return jnp.sum(quaxlike.quaxify(lambda m: m @ x)(m))

    def ref(w, a, b):
        return jnp.sum((w + a @ b) @ x)

    got, expected = jit(
        lambda ms: (
            [jax.grad(loss)(m) for m in ms],
            jax.grad(ref, (0, 1, 2))(ms[1].w, ms[1].a, ms[1].b),
        )
    )((frozen, free))
    assert not np.any(np.asarray(got[0].w))
    assert tree_allclose((got[0].a, got[0].b), expected[1:], rtol=RTOL)
    assert tree_allclose((got[1].w, got[1].a, got[1].b), expected, rtol=RTOL)


def _scaled_loss(s, m, x, y):
    # A traced scalar times the LoRA, then slicing, a second scaling, and stacking.
    first = jnp.sum(jnp.sin(x @ ((s * m)[1:] * s)))
    stacked = lax.scan(lambda c, t: (c, m[0] * (s * t)), 0.0, jnp.arange(1.0, 3.0))[1]
    return first + jnp.sum(jnp.sin(stacked @ y))


@functools.cache
def _scaled_grads(seed, stop_gradient):
    """Gradients of `_scaled_loss` with respect to (s, A, B), quaxified and plain."""
    lora = make_lora(seed, (3, M, N), stop_gradient=stop_gradient)
    x, y = randn(seed + 1, (M,)), randn(seed + 2, (N,))

    def loss(s, a, b):
        return quaxlike.quaxify(_scaled_loss)(s, lora.with_factors(lora.w, a, b), x, y)

    def ref(s, a, b):
        w = lax.stop_gradient(lora.w) if stop_gradient else lora.w
        return _scaled_loss(s, w + jnp.einsum("...mr,...rn->...mn", a, b), x, y)

    both = jit(lambda *args: (jax.grad(loss, (0, 1, 2))(*args), jax.grad(ref, (0, 1, 2))(*args)))
    return both(2.0, lora.a, lora.b)


def test_traced_scalar_gradient():
    got, expected = _scaled_grads(5, stop_gradient=False)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_traced_scalar_gradient_through_frozen_weight():
    # A frozen W gets no gradient, but the gradient of the scalar goes through it:
    # d/ds (s W) = W, as on the dense array with `stop_gradient` at W alone.
    got, expected = _scaled_grads(5, stop_gradient=True)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_issue_scalar_times_frozen_lora_gradient():
    # The reproducer of issue 34 (cause 6), against the dense computation.
    lora = LoraArray(jr.normal(jr.key(3), (M, N)), rank=2, key=jr.key(4))
    lora = eqx.tree_at(lambda m: m.b, lora, jr.normal(jr.key(5), lora.b.shape))
    x = jr.normal(jr.key(6), (N,))
    f = lambda s: quaxlike.quaxify(lambda s, w, x: (s * w) @ x)(s, lora, x).sum()  # noqa: E731
    dense = lambda s: ((s * lora.dense()) @ x).sum()  # noqa: E731
    assert jnp.allclose(jax.grad(f)(2.0), jax.grad(dense)(2.0), rtol=RTOL, atol=ATOL)
    # The answer without the `W` term, which this used to give, is far from it.
    assert not jnp.allclose(jax.grad(f)(2.0), (lora.a @ lora.b @ x).sum(), rtol=0.1)


# --- structural primitives --------------------------------------------------------

# name -> (lora shape, function): each result is a LoraArray again.
STRUCTURAL_CASES = {
    "transpose": ((M, N), lambda m: m.T),
    "transpose_batch": ((2, 3, M, N), lambda m: jnp.transpose(m, (1, 0, 3, 2))),
    "mul_scalar": ((M, N), lambda m: m * 3.0),
    "scalar_mul": ((M, N), lambda m: 0.5 * m),
    "div_scalar": ((M, N), lambda m: m / 4.0),
    "neg": ((M, N), lambda m: -m),
    "astype": ((M, N), lambda m: m.astype(jnp.float16)),
    "expand_dims": ((M, N), lambda m: m[None]),
    "reshape_add_one": ((3, M, N), lambda m: m.reshape(1, 3, M, N)),
    "reshape_merge": ((2, 3, M, N), lambda m: m.reshape(6, M, N)),
    "reshape_split": ((6, M, N), lambda m: m.reshape(2, 3, M, N)),
    "broadcast_batch": ((1, M, N), lambda m: jnp.broadcast_to(m, (3, M, N))),
    "squeeze": ((1, M, N), lambda m: m[0]),
    "squeeze_fn": ((3, 1, M, N), lambda m: jnp.squeeze(m, 1)),
    "index": ((4, M, N), lambda m: m[2]),
    "index_negative": ((4, M, N), lambda m: m[-1]),
    "slice_batch": ((4, M, N), lambda m: m[1:3]),
    "slice_strided": ((5, M, N), lambda m: m[::2]),
    "slice_rows": ((M, N), lambda m: m[1:4]),
    "slice_cols": ((2, M, N), lambda m: m[..., 1:4]),
    "fancy_index": ((4, M, N), lambda m: m[jnp.array([3, 0, 3])]),
    "dynamic_index": ((4, M, N), lambda m: lax.dynamic_index_in_dim(m, 2, 0, keepdims=False)),
    "dynamic_slice": ((4, M, N), lambda m: lax.dynamic_slice(m, (1, 2, 0), (2, 3, N))),
    "copy": ((M, N), lambda m: jnp.array(m, copy=True)),
    "stop_gradient": ((M, N), lax.stop_gradient),
    "scaled_chain": (
        (2, 3, M, N),
        lambda m: jnp.transpose(-(m * 3.0).reshape(6, M, N)[jnp.array([1, 4])], (0, 2, 1)),
    ),
    "scaled_index": ((4, M, N), lambda m: lax.dynamic_index_in_dim(m / 2.0, 1, 0, False)[None]),
}

STRUCTURAL = CaseTable(
    {
        name: (fn, (make_lora(100 + i, shape),))
        for i, (name, (shape, fn)) in enumerate(STRUCTURAL_CASES.items())
    }
)


@pytest.mark.parametrize("case", list(STRUCTURAL_CASES))
def test_structural_stays_lora(case):
    got, expected = STRUCTURAL.got[case], STRUCTURAL.expected[case]
    assert isinstance(got, LoraArray)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = 2e-3 if got.dtype == jnp.float16 else RTOL
    assert tree_allclose(STRUCTURAL.got_dense[case], expected, rtol=tol, atol=tol)


def test_traced_indices(getseed):
    # `m[i]` with a traced `i` (dynamic_slice) and `jax.vmap` of it (gather); `m[:, 1]`
    # (a row of each matrix: the result is dense, built from one row of A).
    lora = make_lora(getseed(), (4, M, N))
    x = randn(getseed(), (N,))
    idx = jax.device_put(np.array([1, 3, -2], np.int32))

    def f(m, idx):
        return (
            [m[i] @ x for i in idx],
            jax.vmap(lambda i: m[i] @ x)(idx),
            m[:, 1],
        )

    got, expected = jit(lambda m, i: (quaxlike.quaxify(f)(m, i), f(dense(m), i)))(lora, idx)
    assert not isinstance(got[2], quaxlike.Value)
    assert tree_allclose(got, expected, rtol=RTOL)
    assert dense_products(quaxlike.quaxify(f), lora, idx) == []


def test_arrays_may_be_values(getseed):
    # The rules redispatch through quaxify, so W, A and B may be Values themselves:
    # here symbolic zeros, for the factors and then for the weight.
    w, x = randn(getseed(), (M, N)), randn(getseed(), (N,))
    lora = make_lora(getseed())
    zero_factors = lora.with_factors(w, Zero((M, R), jnp.float32), Zero((R, N), jnp.float32))
    zero_weight = LoraArray(Zero((M, N), jnp.float32), rank=R, key=_KEY)
    zero_weight = zero_weight.with_factors(zero_weight.w, lora.a, lora.b)
    assert zero_weight.shape == (M, N) and zero_weight.dtype == jnp.float32

    def f(m, x):
        return (m[1:] * 2.0).T.T @ x

    got = jit(lambda *ms: [quaxlike.quaxify(f)(m, x) for m in ms])(zero_factors, zero_weight)
    expected = [f(w, x), f(lora.a @ lora.b, x)]
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


# --- vmap -------------------------------------------------------------------------


def g(m, x):
    return jnp.tanh(m @ x)


def test_vmap_outside_over_batch_of_loras(getseed):
    stacked = make_lora(getseed(), (4, M, N))
    xs, x = randn(getseed(), (4, N)), randn(getseed(), (N,))

    def f(s, xs, x):
        return jax.vmap(quaxlike.quaxify(g))(s, xs), jax.vmap(quaxlike.quaxify(g), (0, None))(s, x)

    def ref(s, xs, x):
        return jax.vmap(g)(dense(s), xs), jax.vmap(g, (0, None))(dense(s), x)

    got, expected = jit(lambda *args: (f(*args), ref(*args)))(stacked, xs, x)
    assert tree_allclose(got, expected, rtol=RTOL)


# vmap inside quaxify: name -> (function of (lora, x), lora shape, x shape).
VMAP_CASES = {
    "lora": (lambda m, x: jax.vmap(g, in_axes=(0, None))(m, x), (4, M, N), (N,)),
    "both": (lambda m, x: jax.vmap(g)(m, x), (4, M, N), (4, N)),
    "x": (lambda m, x: jax.vmap(g, in_axes=(None, 0))(m, x), (M, N), (4, N)),
    "x_axis1": (lambda m, x: jax.vmap(g, in_axes=(0, 1))(m, x), (4, M, N), (N, 4)),
    "closed_over": (lambda m, x: jax.vmap(lambda v: v @ m)(x), (M, N), (4, M)),
    "nested": (lambda m, x: jax.vmap(jax.vmap(g, (0, None)), (None, 0))(m, x), (3, M, N), (4, N)),
}

VMAPS = CaseTable(
    {
        name: (fn, (make_lora(200 + i, lora_shape), randn(300 + i, x_shape)))
        for i, (name, (fn, lora_shape, x_shape)) in enumerate(VMAP_CASES.items())
    }
)


@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_inside(case):
    assert tree_allclose(VMAPS.got[case], VMAPS.expected[case], rtol=RTOL)


def test_vmap_inside_builds_no_dense_block():
    assert VMAPS.dense_products == []


# --- control flow -----------------------------------------------------------------


def test_scan_over_stacked_lora_jit_grad(getseed):
    lora = make_lora(getseed(), (3, M, M), scale=0.4)
    h0 = randn(getseed(), (M,))

    def f(layers, h):
        return lax.scan(lambda h, layer: (jnp.tanh(layer @ h), None), h, layers)[0]

    def loss(a, b):
        return jnp.sum(quaxlike.quaxify(f)(lora.with_factors(lora.w, a, b), h0) ** 2)

    def ref(a, b):
        return jnp.sum(f(lora.w + jnp.einsum("lmr,lrn->lmn", a, b), h0) ** 2)

    def both(a, b):
        return jax.value_and_grad(loss, (0, 1))(a, b), jax.value_and_grad(ref, (0, 1))(a, b)

    got, expected = jit(both)(lora.a, lora.b)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert dense_products(quaxlike.quaxify(f), lora, h0, m=M, n=M) == []


def test_fori_loop_indexing_stacked_lora(getseed):
    # Layer i picked with `layers[i]` (dynamic_slice + squeeze) in a loop.
    lora = make_lora(getseed(), (3, M, M), scale=0.4)
    h0 = randn(getseed(), (M,))

    def f(layers, h):
        return lax.fori_loop(0, layers.shape[0], lambda i, h: jnp.tanh(layers[i] @ h), h)

    got, expected = jit(lambda m, h: (quaxlike.quaxify(f)(m, h), f(dense(m), h)))(lora, h0)
    assert tree_allclose(got, expected, rtol=RTOL)
    assert dense_products(quaxlike.quaxify(f), lora, h0, m=M, n=M) == []


def test_filter_vmap_stacked_model_with_scan(getseed):
    # Stacked Linears built with eqx.filter_vmap, LoRA'd, run layer by layer with scan.
    @eqx.filter_jit
    def make(key):
        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(M, M, key=k))(jr.split(key, 3))
        return loraify(layers, rank=R, key=key)  # loraify under jit, too

    model = make(jr.key(1))
    (lora,) = loras(model)
    assert lora.shape == (3, M, M) and lora.a.shape == (3, M, R)
    model = eqx.tree_at(lambda m: m.weight.b, model, randn(getseed(), lora.b.shape))
    h0 = randn(getseed(), (M,))

    def run(layers, h):
        params, static = eqx.partition(layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return lax.scan(body, h, params)[0]

    got, expected = eqx.filter_jit(lambda m, h: (quaxlike.quaxify(run)(m, h), run(merge(m), h)))(
        model, h0
    )
    assert tree_allclose(got, expected, rtol=RTOL)


def test_cond_and_while_loop(getseed):
    lora = make_lora(getseed(), (M, M))
    x = randn(getseed(), (M,))

    def f(m, x, p):
        y = lax.cond(p, lambda: (m * 2.0) @ x, lambda: m[:, 1:3] @ jnp.ones(2))

        def body(c):
            i, h = c
            return i + 1, jnp.tanh(m.T @ h)

        return y, lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    both = jit(lambda m, x, p: (quaxlike.quaxify(f)(m, x, p), f(dense(m), x, p)))
    for pred in (True, False):
        got, expected = both(lora, x, jax.device_put(np.bool_(pred)))
        assert tree_allclose(got, expected, rtol=RTOL)


# --- loraify / partition / merge --------------------------------------------------


@pytest.fixture(scope="module")
def mlp():
    return eqx.filter_jit(lambda k: eqx.nn.MLP(5, 3, 8, depth=2, key=k))(jr.key(0))


def lora_paths(model):
    paths = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_lora)[0]
    return sorted(jax.tree_util.keystr(p) for p, leaf in paths if is_lora(leaf))


def test_loraify_default_replaces_linear_weights(mlp):
    model = loraify(mlp, rank=R, key=jr.key(1))
    assert lora_paths(model) == [f".layers[{i}].weight" for i in range(3)]
    # A different key per layer.
    a0, a1 = loras(model)[0].a, loras(model)[1].a
    assert a0.shape == a1.shape and not np.allclose(np.asarray(a0), np.asarray(a1))
    # Already-LoRA weights are left alone.
    again = loraify(model, rank=3, key=jr.key(2))
    assert lora_paths(again) == lora_paths(model)
    assert all(x.rank == R for x in loras(again))


@pytest.mark.parametrize(
    "where, expected",
    [
        ("layers.*.weight", [0, 1, 2]),
        ("layers.1.weight", [1]),
        ("**.weight", [0, 1, 2]),
        ("**.w*ght", [0, 1, 2]),
        (["layers.0.weight", "layers.2.weight"], [0, 2]),
        (lambda path, leaf: path.endswith("weight") and leaf.shape[0] == 8, [0, 1]),
    ],
    ids=["star", "exact", "doublestar", "partial", "list", "predicate"],
)
def test_loraify_where(mlp, where, expected):
    model = loraify(mlp, rank=R, key=jr.key(1), where=where)
    assert lora_paths(model) == [f".layers[{i}].weight" for i in expected]


def test_loraify_where_errors(mlp):
    # Biases are vectors: a pattern that selects one is refused, naming it.
    for where in ("**", "layers.2.*"):
        with pytest.raises(ValueError, match=r"layers\.\d\.bias.*at least two dimensions"):
            loraify(mlp, rank=R, key=jr.key(1), where=where)
    with pytest.raises(ValueError, match=r"selected no leaf.*layers\.0\.weight"):
        loraify(mlp, rank=R, key=jr.key(1), where="layer.*.weight")
    with pytest.raises(TypeError, match="where"):
        loraify(mlp, rank=R, key=jr.key(1), where=3)
    # No Linear at all, and no `where`: say how to select weights.
    params = {"proj": randn(0, (4, 3)), "scale": randn(1, (3,))}
    with pytest.raises(ValueError, match="no `eqx.nn.Linear`.*where="):
        loraify(params, rank=R, key=jr.key(1))
    adapted = loraify(params, rank=R, key=jr.key(1), where="proj")  # a dict key
    assert is_lora(adapted["proj"]) and not is_lora(adapted["scale"])


def test_partition_and_merge(mlp):
    model = loraify(mlp, rank=R, key=jr.key(1))
    trainable, frozen = partition(model)
    shapes = sorted(tuple(x.shape) for x in jax.tree_util.tree_leaves(trainable))
    assert shapes == sorted([(8, R), (R, 5), (8, R), (R, 8), (3, R), (R, 8)])
    structure = jax.tree_util.tree_structure(model)
    assert jax.tree_util.tree_structure(eqx.combine(trainable, frozen)) == structure
    assert jax.tree_util.tree_structure(trainable_filter(model)) == structure
    assert all(x.w is None for x in loras(trainable))
    assert all(x.a is None and x.b is None for x in loras(frozen))
    merged = merge(model)
    assert not loras(merged)
    assert tree_allclose(merged, mlp, rtol=RTOL)  # b starts at zero


# --- end to end ---------------------------------------------------------------------


def test_train_mlp_end_to_end(mlp):
    xs = randn(0, (16, 5))
    ys = jax.device_put(np.sin(np.asarray(xs)[:, :3]))
    model = loraify(mlp, rank=R, key=jr.key(2), scale=0.1)
    trainable, frozen = partition(model)
    optimiser = optax.adam(3e-2)
    opt_state = jit(optimiser.init)(trainable)

    def loss_fn(trainable):
        model = eqx.combine(trainable, frozen)
        return jnp.mean((jax.vmap(quaxlike.quaxify(model))(xs) - ys) ** 2)

    @eqx.filter_jit
    def step(trainable, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    new = trainable
    for _ in range(10):
        new, opt_state, loss = step(new, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0]
    trained = eqx.combine(new, frozen)
    for old, fresh in zip(loras(model), loras(trained)):
        assert tree_allclose(fresh.w, old.w)  # base weights unchanged
        assert not tree_allclose(fresh.b, old.b)
    assert tree_allclose([la.bias for la in trained.layers], [la.bias for la in mlp.layers])

    @eqx.filter_jit
    def outputs(trained):
        return (
            jax.vmap(quaxlike.quaxify(trained))(xs),
            jax.vmap(merge(trained))(xs),
            jax.vmap(mlp)(xs),
        )

    lora_out, merged_out, original_out = outputs(trained)
    assert tree_allclose(lora_out, merged_out, rtol=RTOL, atol=ATOL)
    assert not tree_allclose(lora_out, original_out, rtol=1e-3, atol=1e-3)
    # The training step builds no (8, 8) block.
    assert dense_products(lambda t: step(t, opt_state)[2], trainable, m=8, n=8) == []
