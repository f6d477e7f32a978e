"""LoRA for convolutions: `LoraConvKernel` and its rules, compared with plain JAX on
the merged kernel `W + A · B` (forward and gradients), for `lax.conv_general_dilated`
with strides, padding, dilations, feature and batch groups and several layouts, for
Equinox's Conv1d/2d/3d and ConvTranspose1d/2d/3d, and for `loraify` on a small CNN.

Speed: the case table is run as one jitted program (and its reference as another),
then checked case by case.
"""

import functools
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import tree_allclose
from jax import lax

import quaxlike
from quaxlike.lora import (
    adapted_paths,
    LoraArray,
    LoraConvKernel,
    loraify,
    merge,
    partition,
)
from quaxlike.symbolic.zero import Zero


RTOL, ATOL = 1e-4, 1e-4
R = 2  # the rank; distinct from every channel count below, so shapes tell W and B apart

jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def randn(seed, shape, scale=1.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return jax.device_put((scale * rng.standard_normal(shape)).astype(dtype))


def merged_kernel(w, a, b, out_axis):
    """`W + A · B` by hand: contract A's rank with B's `out_axis`."""
    update = jnp.tensordot(a, b, axes=((1,), (out_axis,)))
    return w + jnp.moveaxis(update, 0, out_axis)


def factors(seed, shape, out_axis, rank=R):
    w = randn(seed, shape, 0.5)
    a = randn(seed + 1, (shape[out_axis], rank), 0.5)
    b_shape = list(shape)
    b_shape[out_axis] = rank
    return w, a, randn(seed + 2, tuple(b_shape), 0.5)


def with_weight(layer, kernel):
    return eqx.tree_at(lambda c: c.weight, layer, kernel)


def _conv(**kw):
    return lambda x, k: lax.conv_general_dilated(x, k, **kw)


# name -> (function of (x, kernel), x shape, kernel shape, out_axis)
CASES = {
    "conv1d": (_conv(window_strides=(1,), padding="SAME"), (2, 3, 9), (5, 3, 3), 0),
    "conv1d_stride_padding_dilation": (
        _conv(window_strides=(2,), padding=((2, 1),), rhs_dilation=(2,)),
        (2, 3, 11),
        (5, 3, 3),
        0,
    ),
    "conv2d_groups_lhs_dilation": (
        _conv(
            window_strides=(2, 1),
            padding=((1, 2), (0, 1)),
            lhs_dilation=(1, 2),
            rhs_dilation=(2, 1),
            feature_group_count=2,
        ),
        (2, 4, 7, 6),
        (6, 2, 3, 2),
        0,
    ),
    "conv2d_depthwise": (
        _conv(window_strides=(1, 1), padding="SAME", feature_group_count=4),
        (1, 4, 6, 6),
        (8, 1, 3, 3),
        0,
    ),
    "conv2d_batch_groups": (
        _conv(window_strides=(1, 2), padding="VALID", batch_group_count=2),
        (4, 3, 7, 6),
        (6, 3, 3, 2),
        0,
    ),
    "conv2d_nhwc_hwio": (
        _conv(
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
        (2, 6, 5, 3),
        (3, 3, 3, 5),
        3,
    ),
    "conv3d": (
        _conv(window_strides=(1, 2, 1), padding="SAME"),
        (1, 3, 5, 4, 5),
        (5, 3, 2, 3, 2),
        0,
    ),
    # The kernel's out_axis is the convolution's input-feature axis.
    "rank_on_input_axis_groups": (
        _conv(window_strides=(2,), padding=((1, 1),), rhs_dilation=(2,), feature_group_count=2),
        (2, 4, 9),
        (6, 2, 3),
        1,
    ),
    "rank_on_input_axis_batch_groups": (
        _conv(window_strides=(1,), padding="VALID", batch_group_count=2),
        (4, 3, 9),
        (6, 3, 3),
        1,
    ),
    # lax.conv_transpose flips and transposes the kernel (transpose and rev rules).
    "conv_transpose_flipped_kernel": (
        lambda x, k: lax.conv_transpose(
            x, k, (2,), "SAME", dimension_numbers=("NCH", "OIH", "NCH"), transpose_kernel=True
        ),
        (2, 5, 5),
        (5, 3, 3),
        0,
    ),
}


def layer_with_random_arrays(cls, *args, **kwargs):
    """An Equinox layer with NumPy-seeded arrays: its own random initialisation
    would compile a program per shape, which costs more than the tests."""
    shapes = eqx.filter_eval_shape(cls, *args, **kwargs, key=jr.key(0))
    seeds = iter(range(100, 200))
    return jax.tree_util.tree_map(
        lambda s: randn(next(seeds), s.shape, 0.3) if isinstance(s, jax.ShapeDtypeStruct) else s,
        shapes,
    )


# Equinox's layers and the shapes of their (unbatched) inputs. The kernel is their
# `(out, in / groups, *kernel_size)` weight. Those covered by a `lax` case above
# (1-D, 3-D) are in the slow sweep.
_LAYERS = {
    "eqx_conv1d": (layer_with_random_arrays(eqx.nn.Conv1d, 3, 5, 3, stride=2, padding=1), (3, 9)),
    "eqx_conv2d_groups": (
        layer_with_random_arrays(
            eqx.nn.Conv2d, 4, 6, (3, 2), padding="SAME", dilation=(1, 2), groups=2
        ),
        (4, 6, 7),
    ),
    "eqx_conv3d": (layer_with_random_arrays(eqx.nn.Conv3d, 3, 5, 2, padding=1), (3, 4, 3, 4)),
    "eqx_conv_transpose1d": (
        layer_with_random_arrays(eqx.nn.ConvTranspose1d, 3, 5, 3, stride=2, output_padding=1),
        (3, 6),
    ),
    "eqx_conv_transpose2d_groups": (
        layer_with_random_arrays(
            eqx.nn.ConvTranspose2d, 4, 6, 3, stride=(2, 1), padding=1, groups=2
        ),
        (4, 5, 4),
    ),
    "eqx_conv_transpose3d": (
        layer_with_random_arrays(eqx.nn.ConvTranspose3d, 3, 5, 2, stride=2),
        (3, 3, 2, 3),
    ),
}
SLOW = {"eqx_conv1d", "eqx_conv3d", "eqx_conv_transpose3d"}
for _name, (_layer, _x_shape) in _LAYERS.items():
    CASES[_name] = (
        functools.partial(lambda layer, x, k: with_weight(layer, k)(x), _layer),
        _x_shape,
        tuple(_layer.weight.shape),
        0,
    )


def _inputs(names=tuple(CASES)):
    return {
        name: (randn(10 * i, x_shape), *factors(10 * i + 3, k_shape, axis))
        for i, (name, (_, x_shape, k_shape, axis)) in enumerate(CASES.items())
        if name in names
    }


def _probe(name, out_shape):
    # A fixed random cotangent per case, so every output element matters.
    return randn(1000 + sorted(CASES).index(name), out_shape)


def _losses(kernels, xs, run):
    outs = {name: run(CASES[name][0], xs[name], kernels[name]) for name in xs}
    loss = sum(jnp.vdot(out, _probe(name, out.shape)) for name, out in outs.items())
    return loss, outs


@functools.cache
def _results(slow: bool):
    """Outputs and gradients with respect to (x, W, A, B), LoRA and merged, for
    the fast cases or for the slow ones."""
    inputs = _inputs(tuple(name for name in CASES if (name in SLOW) == slow))

    def lora_loss(params):
        xs = {name: p[0] for name, p in params.items()}
        kernels = {
            name: LoraConvKernel.from_factors(w, a, b, out_axis=CASES[name][3], stop_gradient=False)
            for name, (_, w, a, b) in params.items()
        }
        return _losses(kernels, xs, lambda fn, x, k: quaxlike.quaxify(fn)(x, k))

    def dense_loss(params):
        xs = {name: p[0] for name, p in params.items()}
        kernels = {
            name: merged_kernel(w, a, b, CASES[name][3]) for name, (_, w, a, b) in params.items()
        }
        return _losses(kernels, xs, lambda fn, x, k: fn(x, k))

    got = jit(jax.value_and_grad(lora_loss, has_aux=True))(inputs)
    want = jit(jax.value_and_grad(dense_loss, has_aux=True))(inputs)
    return got, want


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_conv_forward_and_grads(case):
    ((_, got_out), got_grads), ((_, want_out), want_grads) = _results(case in SLOW)
    assert tree_allclose(got_out[case], want_out[case], rtol=RTOL, atol=ATOL)
    # Gradients with respect to the input, W, A and B.
    assert tree_allclose(got_grads[case], want_grads[case], rtol=RTOL, atol=ATOL)


def _kernel_products(fn, *args, shapes):
    """Equations that compute an array of a kernel's shape by arithmetic (as forming
    `W + A · B` would); flips and transposes of `W` alone do not count."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("add", "add_any", "sub", "mul", "dot_general"):
                shape = tuple(eqn.outvars[0].aval.shape)
                if sorted(shape) in shapes:
                    found.append((eqn.primitive.name, shape))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_never_forms_the_kernel():
    inputs = _inputs(tuple(name for name in CASES if name not in SLOW))
    shapes = [sorted(CASES[name][2]) for name in CASES]

    def loss(xs_and_factors):
        # W frozen (the default): gradients with respect to x, A and B only.
        kernels = {
            name: LoraConvKernel.from_factors(w, a, b, out_axis=CASES[name][3])
            for name, (_, w, a, b) in xs_and_factors.items()
        }
        xs = {name: p[0] for name, p in xs_and_factors.items()}
        return _losses(kernels, xs, lambda fn, x, k: quaxlike.quaxify(fn)(x, k))[0]

    assert _kernel_products(jax.grad(loss), inputs, shapes=shapes) == []
    # The check can fail: the same with the dense kernel built.
    name = "conv1d"
    x, w, a, b = inputs[name]
    kernel = LoraConvKernel.from_factors(w, a, b)
    dense = lambda x, k: CASES[name][0](x, k.dense())  # noqa: E731
    assert _kernel_products(dense, x, kernel, shapes=shapes) != []


def test_frozen_kernel_has_zero_gradient(getseed):
    x = randn(getseed(), (2, 3, 9))
    kernel = LoraConvKernel.from_factors(*factors(getseed(), (5, 3, 3), 0))
    fn = CASES["conv1d"][0]
    grads = jax.grad(lambda k: quaxlike.quaxify(fn)(x, k).sum())(kernel)
    assert not np.any(np.asarray(grads.w))
    assert np.any(np.asarray(grads.a)) and np.any(np.asarray(grads.b))


def test_precision_and_preferred_element_type(getseed):
    x = randn(getseed(), (2, 4, 8), dtype=jnp.bfloat16)
    w, a, b = (v.astype(jnp.bfloat16) for v in factors(getseed(), (6, 2, 3), 0))
    kernel = LoraConvKernel.from_factors(w, a, b)

    def fn(x, k):
        return lax.conv_general_dilated(
            x,
            k,
            (1,),
            "SAME",
            feature_group_count=2,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )

    got = jit(quaxlike.quaxify(fn))(x, kernel)
    want = fn(x, merged_kernel(w, a, b, 0))
    assert got.dtype == want.dtype == jnp.float32
    # The merged kernel is rounded to bfloat16; the factors are not.
    assert np.allclose(got, want, rtol=2e-2, atol=2e-1)


# --- structure ----------------------------------------------------------------------


def test_construction_draws_a_and_zero_b():
    w = randn(0, (6, 2, 3, 3))
    kernel = LoraConvKernel(w, rank=3, key=jr.key(4), scale=0.1)
    assert kernel.shape == (6, 2, 3, 3) and kernel.rank == 3 and kernel.out_axis == 0
    assert kernel.a.shape == (6, 3) and kernel.b.shape == (3, 2, 3, 3)
    assert np.array_equal(kernel.a, jr.normal(jr.key(4), (6, 3)) * 0.1)
    assert not np.any(np.asarray(kernel.b))
    hwio = LoraConvKernel(jnp.transpose(w, (2, 3, 1, 0)), rank=3, key=jr.key(4), out_axis=-1)
    assert hwio.out_axis == 3 and hwio.b.shape == (3, 3, 2, 3)


@pytest.mark.parametrize(
    "weight, kwargs, match",
    [
        (np.ones((4, 3), np.float32), {}, "at least three dimensions.*LoraArray"),
        (np.ones((4, 3, 3), np.int32), {}, "floating-point"),
        (np.ones((4, 3, 3), np.float32), {"out_axis": 3}, "out_axis.*Flax"),
        (np.ones((4, 3, 3), np.float32), {"rank": 0}, "positive integer"),
    ],
)
def test_construction_errors(weight, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConvKernel(weight, **{"rank": 2, "key": jr.key(0), **kwargs})


def test_from_factors_checks_shapes():
    w, a, b = factors(0, (5, 3, 3), 0)
    with pytest.raises(ValueError, match=r"`a` must have shape \(5, rank\)"):
        LoraConvKernel.from_factors(w, a[:4], b)


STRUCTURAL_CASES = {
    "flip": lambda k: lax.rev(k, (0, 2)),
    "transpose": lambda k: jnp.transpose(k, (2, 0, 1)),
    "scale": lambda k: 2.5 * k,
    "divide": lambda k: k / 4.0,
    "negate": lambda k: -k,
    "astype": lambda k: k.astype(jnp.float16),
    "stop_gradient": lax.stop_gradient,
}


@pytest.mark.parametrize("case", list(STRUCTURAL_CASES))
def test_structural_stays_a_lora_kernel(case, getseed):
    w, a, b = factors(getseed(), (5, 3, 4), 0)
    kernel = LoraConvKernel.from_factors(w, a, b)
    fn = STRUCTURAL_CASES[case]
    out = quaxlike.quaxify(fn)(kernel)
    assert isinstance(out, LoraConvKernel)
    want = fn(merged_kernel(w, a, b, 0))
    got = merged_kernel(out.w, out.a, out.b, out.out_axis)
    assert got.dtype == want.dtype
    assert np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_refuses_to_materialise(getseed):
    kernel = LoraConvKernel.from_factors(*factors(getseed(), (5, 3, 3), 0))
    with pytest.raises(quaxlike.MaterialisationError, match="LoraConvKernel of shape"):
        quaxlike.quaxify(jnp.exp)(kernel)
    allowed = LoraConvKernel.from_factors(kernel.w, kernel.a, kernel.b, allow_materialise=True)
    got = quaxlike.quaxify(jnp.exp)(allowed)
    assert np.allclose(got, jnp.exp(merged_kernel(kernel.w, kernel.a, kernel.b, 0)), rtol=RTOL)


def test_lora_array_as_kernel_is_refused(getseed):
    lora = LoraArray(randn(getseed(), (5, 3, 3, 3)), rank=R, key=jr.key(0))
    with pytest.raises(ValueError, match="LoraArray.*kernel.*LoraConvKernel"):
        conv = _conv(window_strides=(1, 1), padding="SAME")
        quaxlike.quaxify(conv)(randn(getseed(), (1, 3, 4, 4)), lora)


def test_grad_inside_quaxify(getseed):
    # jax.grad inside quaxify transposes the convolution with the kernel as a
    # constant: fine without groups, refused (with a way out) with them.
    for case, works in (
        ("conv_transpose_flipped_kernel", True),
        ("conv2d_groups_lhs_dilation", False),
    ):
        fn, x_shape, k_shape, axis = CASES[case]
        x = randn(getseed(), x_shape)
        w, a, b = factors(getseed(), k_shape, axis)
        kernel = LoraConvKernel.from_factors(w, a, b, out_axis=axis)
        grad_x = lambda x, k: jax.grad(lambda x: jnp.sin(fn(x, k)).sum())(x)  # noqa: E731
        if works:
            got = jit(quaxlike.quaxify(grad_x))(x, kernel)
            assert tree_allclose(got, grad_x(x, merged_kernel(w, a, b, axis)), rtol=RTOL, atol=ATOL)
        else:
            with pytest.raises(ValueError, match="reshape a LoraConvKernel.*outside `quaxify`"):
                quaxlike.quaxify(grad_x)(x, kernel)


# --- loraify on a CNN -----------------------------------------------------------------


class SmallCNN(eqx.Module):
    convs: list
    up: eqx.nn.ConvTranspose2d
    norm: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.convs = [
            eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1),
            eqx.nn.Conv2d(8, 8, 3, stride=2, groups=2, key=k2),
        ]
        self.up = eqx.nn.ConvTranspose2d(8, 4, 3, stride=2, key=k3)
        self.norm = eqx.nn.GroupNorm(2, 4)
        self.head = eqx.nn.Linear(4, 3, key=k4)

    def __call__(self, x):
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
        x = self.norm(self.up(x))
        return self.head(jnp.mean(x, axis=(1, 2)))


@pytest.fixture(scope="module")
def cnn():
    return layer_with_random_arrays(SmallCNN)


def test_loraify_cnn_default(cnn):
    model = loraify(cnn, rank=R, key=jr.key(1))
    assert adapted_paths(model) == ["convs.0.weight", "convs.1.weight", "up.weight", "head.weight"]
    assert all(isinstance(c.weight, LoraConvKernel) for c in (*model.convs, model.up))
    assert isinstance(model.head.weight, LoraArray)
    # The same leaves with a pattern; norms and biases are not selected by default.
    again = loraify(
        cnn, rank=R, key=jr.key(1), where=["convs.*.weight", "up.weight", "head.weight"]
    )
    assert adapted_paths(again) == adapted_paths(model)
    assert tree_allclose(again, model)


def test_loraify_cnn_training_step(cnn):
    """Forward and gradients of the LoRA CNN equal those of the merged model, under
    jit, with vmap outside and inside quaxify."""
    model = loraify(cnn, rank=R, key=jr.key(1), scale=0.3)
    # Non-zero B, so that the update matters.
    model = jax.tree_util.tree_map(
        lambda x: (
            x.with_factors(x.w, x.a, randn(3, x.b.shape, 0.3))
            if isinstance(x, LoraConvKernel)
            else x
        ),
        model,
        is_leaf=lambda x: isinstance(x, LoraConvKernel),
    )
    xs = randn(0, (2, 3, 9, 9))
    trainable, frozen = partition(model)

    @jit
    def lora(trainable):
        def loss(trainable):
            out = jax.vmap(quaxlike.quaxify(eqx.combine(trainable, frozen)))(xs)
            return jnp.sum(jnp.sin(out)) + jnp.sum(out**2), out

        model = eqx.combine(trainable, frozen)
        inside = quaxlike.quaxify(lambda m, xs: jax.vmap(m)(xs))(model, xs)
        return jax.value_and_grad(loss, has_aux=True)(trainable), inside

    @jit
    def merged(trainable):
        def loss(trainable):
            # The merged weights, by hand; gradients reach A and B through them.
            def merge_leaf(x):
                if isinstance(x, LoraConvKernel):
                    return merged_kernel(lax.stop_gradient(x.w), x.a, x.b, x.out_axis)
                if isinstance(x, LoraArray):
                    return lax.stop_gradient(x.w) + x.a @ x.b
                return x

            m = jax.tree_util.tree_map(
                merge_leaf,
                eqx.combine(trainable, frozen),
                is_leaf=lambda x: isinstance(x, (LoraArray, LoraConvKernel)),
            )
            out = jax.vmap(m)(xs)
            return jnp.sum(jnp.sin(out)) + jnp.sum(out**2), out

        return jax.value_and_grad(loss, has_aux=True)(trainable)

    ((got_loss, outside), got_grads), inside = lora(trainable)
    (want_loss, want), want_grads = merged(trainable)
    assert np.allclose(got_loss, want_loss, rtol=RTOL)
    assert tree_allclose(outside, want, rtol=RTOL, atol=ATOL)
    assert tree_allclose(inside, want, rtol=RTOL, atol=ATOL)
    assert tree_allclose(got_grads, want_grads, rtol=RTOL, atol=ATOL)
    # merge() gives an ordinary CNN computing the same.
    dense = merge(model)
    assert not adapted_paths(dense)
    assert tree_allclose(jax.vmap(dense)(xs), want, rtol=RTOL, atol=ATOL)


def test_loraify_refuses_stacked_convolutions():
    stacked = layer_with_random_arrays(
        lambda key: eqx.filter_vmap(lambda k: eqx.nn.Conv1d(2, 3, 3, key=k))(jr.split(key, 2))
    )
    with pytest.raises(ValueError, match=r"weight.*Conv1d.*\(2, 3, 2, 3\).*stack"):
        loraify(stacked, rank=R, key=jr.key(1))


@pytest.mark.slow  # builds and initialises Equinox layers: mostly compiling random draws
def test_readme_cnn_and_embedding_example():
    """The README's CNN and embedding example runs as written."""
    readme = pathlib.Path(quaxlike.__file__).parent / "lora" / "README.md"
    pattern = r"A CNN and a LoRA'd embedding table:\n\n```python\n(.*?)```"
    (code,) = re.findall(pattern, readme.read_text(), re.S)
    exec(compile(code, str(readme), "exec"), {})


def test_arrays_may_be_values(getseed):
    # The rules redispatch through quaxify, so W, A and B may be Values: symbolic
    # zeros for the factors, then for the kernel.
    fn, x_shape, k_shape, axis = CASES["conv2d_groups_lhs_dilation"]
    x = randn(getseed(), x_shape)
    w, a, b = factors(getseed(), k_shape, axis)
    zero_factors = LoraConvKernel.from_factors(w, Zero(a.shape, a.dtype), Zero(b.shape, b.dtype))
    zero_kernel = LoraConvKernel.from_factors(Zero(w.shape, w.dtype), a, b)
    got = jit(lambda *ks: [quaxlike.quaxify(fn)(x, k) for k in ks])(zero_factors, zero_kernel)
    expected = [fn(x, w), fn(x, merged_kernel(jnp.zeros_like(w), a, b, axis))]
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)
