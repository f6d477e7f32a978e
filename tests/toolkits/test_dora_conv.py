"""DoRA for convolution kernels: `DoraConvKernel`, against the dense formula.

The reference is PEFT's DoRA `Conv1d/2d/3d` formed densely in plain JAX:
`(m / stop_gradient(‖V‖)) ⊙ V` with `V = W + A · B` built as a dense kernel, the
norm per output channel over every other axis. Values, `jax.jvp` and `jax.grad`
with respect to `A`, `B`, `m` and the input, under `jax.jit`, for
`eqx.nn.Conv2d`, `eqx.nn.Conv1d` and a grouped `eqx.nn.ConvTranspose2d`. The kernel
refuses to materialise, so a result at all shows that no rule fell back to the
dense kernel.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn
from jax import lax

import quaxlike
from quaxlike.lora import DoraConvKernel, loraify, merge, partition, trainable_filter
from quaxlike.lora._conv import dense_kernel
from quaxlike.quantized import quantize_int8


R = 3
LAYERS = {
    "conv2d": lambda: eqx.nn.Conv2d(4, 6, kernel_size=3, padding=1, key=jr.key(0)),
    "conv1d": lambda: eqx.nn.Conv1d(4, 6, kernel_size=5, stride=2, dilation=1, key=jr.key(0)),
    "grouped2d": lambda: eqx.nn.Conv2d(4, 6, kernel_size=(3, 2), groups=2, key=jr.key(0)),
    "transpose2d": lambda: eqx.nn.ConvTranspose2d(4, 6, kernel_size=3, stride=2, key=jr.key(0)),
}
INPUTS = {"conv2d": (4, 7, 8), "conv1d": (4, 15), "grouped2d": (4, 6, 5), "transpose2d": (4, 5, 5)}


def factors(w, seed):
    """`A`, `B` and `m` away from their initial values, so every term counts."""
    o = w.shape[0]
    a = randn(seed, (o, R), 0.5)
    b = randn(seed + 1, (R, *w.shape[1:]), 0.3)
    m = jnp.sqrt(jnp.sum(w * w, axis=tuple(range(1, w.ndim)))) * (1 + 0.2 * randn(seed + 2, (o,)))
    return a, b, m


def dense_dora(w, a, b, m):
    """PEFT's DoRA kernel formed densely (the norm detached): the reference."""
    v = w + jnp.tensordot(a, b, axes=((1,), (0,)))
    norm = lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=tuple(range(1, v.ndim)))))
    return (m / norm).reshape(-1, *([1] * (v.ndim - 1))) * v


def run_dora(layer, w, a, b, m, x):
    kernel = DoraConvKernel.from_factors(w, a, b, m)
    return quaxlike.quaxify(eqx.tree_at(lambda c: c.weight, layer, kernel))(x)


def run_dense(layer, w, a, b, m, x):
    return eqx.tree_at(lambda c: c.weight, layer, dense_dora(w, a, b, m))(x)


def close(x, y, tol=2e-5):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape
    scale = max(1.0, float(np.max(np.abs(y))))
    assert np.max(np.abs(x - y)) <= tol * scale, np.max(np.abs(x - y))


@pytest.mark.parametrize("name", list(LAYERS))
def test_values_jvp_and_grad_match_dense_dora(name):
    layer = LAYERS[name]()
    w = layer.weight
    a, b, m = factors(w, 10)
    x = randn(20, INPUTS[name])
    ours = jax.jit(lambda *args: run_dora(layer, w, *args))
    dense = jax.jit(lambda *args: run_dense(layer, w, *args))
    args = (a, b, m, x)
    close(ours(*args), dense(*args))
    assert not np.allclose(ours(*args), layer(x), atol=1e-3)  # the update counts

    tangents = tuple(randn(30 + i, v.shape) for i, v in enumerate(args))
    y1, t1 = jax.jvp(ours, args, tangents)
    y2, t2 = jax.jvp(dense, args, tangents)
    close(y1, y2)
    close(t1, t2)

    cot = randn(40, y2.shape)
    loss = lambda f: lambda *args: jnp.sum(f(*args) * cot)  # noqa: E731
    g1 = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(*args)
    g2 = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(*args)
    for got, want in zip(g1, g2):
        assert float(jnp.max(jnp.abs(want))) > 1e-3  # every gradient is non-trivial
        close(got, want, 5e-5)


def test_norm_is_detached_and_matches_dense():
    layer = LAYERS["conv2d"]()
    w = layer.weight
    a, b, m = factors(w, 50)
    kernel = DoraConvKernel.from_factors(w, a, b, m)
    v = w + jnp.tensordot(a, b, axes=((1,), (0,)))
    close(kernel.norm(), jnp.sqrt(jnp.sum(v * v, axis=(1, 2, 3))), 1e-5)
    grad = jax.grad(lambda a: jnp.sum(DoraConvKernel.from_factors(w, a, b, m).norm()))(a)
    assert np.all(np.asarray(grad) == 0)


def test_loraify_dora_starts_at_the_base_merges_and_trains_m():
    model = eqx.nn.Sequential([LAYERS["conv2d"](), eqx.nn.Lambda(jnp.tanh), LAYERS["grouped2d"]()])
    model = eqx.tree_at(lambda s: s.layers[2], model, eqx.nn.Conv2d(6, 4, 3, key=jr.key(3)))
    x = randn(60, (4, 9, 9))
    dora = loraify(model, rank=R, key=jr.key(1), dora=True)
    kernels = [layer.weight for layer in (dora.layers[0], dora.layers[2])]
    assert all(isinstance(k, DoraConvKernel) for k in kernels)
    close(quaxlike.quaxify(dora)(x), model(x), 1e-5)  # B = 0 and m = ‖W‖: D = W

    spec = trainable_filter(dora)
    assert spec.layers[0].weight.m and spec.layers[0].weight.a and spec.layers[0].weight.b
    assert not spec.layers[0].weight.w and not spec.layers[0].weight.w_norm_sq
    trainable, frozen = partition(dora)
    assert trainable.layers[0].weight.m is not None and trainable.layers[0].weight.w is None

    # Move every factor away from its start, then merge: W' is the dense DoRA kernel.
    moved = dora
    for i, k in ((0, kernels[0]), (2, kernels[1])):
        a, b, m = factors(k.w, 70 + i)
        moved = eqx.tree_at(lambda s: s.layers[i].weight, moved, k._replaced(a=a, b=b, m=m))
    merged = merge(moved)
    for i in (0, 2):
        k = moved.layers[i].weight
        close(merged.layers[i].weight, dense_dora(k.w, k.a, k.b, k.m), 1e-6)
    close(merged(x), quaxlike.quaxify(moved)(x), 2e-5)

    def loss(trainable):
        return jnp.sum(quaxlike.quaxify(eqx.combine(trainable, frozen))(x) ** 2)

    grads = eqx.filter_grad(loss)(partition(moved)[0])
    assert float(jnp.max(jnp.abs(grads.layers[0].weight.m))) > 0


def test_merge_matches_dense_kernel_helper():
    w = randn(80, (5, 3, 2, 2))
    a, b, m = factors(w, 81)
    kernel = DoraConvKernel.from_factors(w, a, b, m)
    v = dense_kernel(w, a, b, 0)
    close(kernel.merged(), dense_dora(w, a, b, m), 1e-6)
    close(DoraConvKernel.from_factors(w, a, b).merged(), v, 1e-5)  # m = ‖V‖: D = V


def test_refusals_name_the_type_and_the_way_out():
    layer = LAYERS["conv2d"]()
    kernel = DoraConvKernel(layer.weight, rank=2, key=jr.key(1))
    with pytest.raises(Exception, match="DoraConvKernel.*merge"):
        quaxlike.quaxify(lambda k: jnp.exp(k))(kernel)
    # A convolution whose output features are not the kernel's output channels.
    with pytest.raises(ValueError, match="conv_general_dilated_p.*DoraConvKernel.*merge"):
        numbers = ("NCHW", "IOHW", "NCHW")
        conv = lambda x, k: lax.conv_general_dilated(  # noqa: E731
            x, k, (1, 1), "SAME", dimension_numbers=numbers
        )
        quaxlike.quaxify(conv)(jnp.ones((1, 6, 7, 7)), kernel)
    with pytest.raises(TypeError, match="DoraConvKernel.*plain array"):
        DoraConvKernel(quantize_int8(layer.weight.reshape(6, -1)), rank=2, key=jr.key(1))
    with pytest.raises(ValueError, match="DoraConvKernel.*magnitude"):
        DoraConvKernel(layer.weight, rank=2, key=jr.key(1), magnitude=jnp.ones(5))


def test_trained_kernel_keeps_its_norm_current():
    """With `stop_gradient=False` the kernel trains: after a step moves `W`, the
    output uses the norm of the current `W' + A · B`, not the one cached when the
    kernel was made, and the gradient reaches `W` as the dense formula's does."""
    layer = LAYERS["conv2d"]()
    x = randn(7, INPUTS["conv2d"])
    a, b, m = factors(layer.weight, 1)
    kernel = DoraConvKernel.from_factors(layer.weight, a, b, m, stop_gradient=False)
    moved_w = layer.weight + 0.5 * randn(9, layer.weight.shape)
    moved = kernel._replaced(w=moved_w)
    got = quaxlike.quaxify(eqx.tree_at(lambda c: c.weight, layer, moved))(x)
    close(got, run_dense(layer, moved_w, a, b, m, x))

    def loss(w):
        conv = eqx.tree_at(lambda c: c.weight, layer, kernel._replaced(w=w))
        return jnp.sum(quaxlike.quaxify(conv)(x) ** 2)

    dense_loss = lambda w: jnp.sum(run_dense(layer, w, a, b, m, x) ** 2)  # noqa: E731
    close(jax.grad(loss)(moved_w), jax.grad(dense_loss)(moved_w), 1e-4)
