"""`LoraArray` and `LoraConvKernel` share one base class, `LowRankValue`: the same
fields, checks, freezing of `W` and refusal to materialise, defined once."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn

from quaxlike.lora import LoraArray, LoraConvKernel, MultiLoraArray
from quaxlike.lora._base import LowRankValue
from quaxlike.quantized import quantize_int8


def test_one_frozen_weight():
    for cls in (LoraArray, LoraConvKernel, MultiLoraArray):
        assert issubclass(cls, LowRankValue)
        assert cls.frozen_weight is LowRankValue.frozen_weight
        assert cls.materialise is LowRankValue.materialise


@pytest.mark.parametrize("cls, shape", [(LoraArray, (4, 3)), (LoraConvKernel, (4, 3, 2))])
def test_shared_checks_name_the_type(cls, shape):
    with pytest.raises(ValueError, match=f"{cls.__name__} needs a positive integer `rank`"):
        cls(jnp.ones(shape), rank=0, key=jr.key(0))
    value = cls(jnp.ones(shape), rank=1, key=jr.key(0))
    with pytest.raises(RuntimeError, match=f"Refusing to materialise a {cls.__name__}"):
        value.materialise()


@pytest.mark.parametrize("cls, shape", [(LoraArray, (4, 6)), (LoraConvKernel, (4, 6, 2))])
def test_frozen_weight_stops_gradients_at_every_leaf_of_a_value(cls, shape):
    # A Value weight is frozen leaf by leaf: no rule for stop_gradient is needed,
    # and the quantised weight is not dequantised to freeze it.
    w = quantize_int8(randn(0, shape))
    value = cls(w, rank=1, key=jr.key(1))
    frozen = value.frozen_weight()
    assert type(frozen) is type(w)

    def total(scale, stop):
        scaled = eqx.tree_at(lambda q: q.scale, w, w.scale * scale)
        v = cls(scaled, rank=1, key=jr.key(1), stop_gradient=stop)
        return jnp.sum(v.frozen_weight().dequantize())

    assert jax.grad(total)(1.0, True) == 0
    assert jax.grad(total)(1.0, False) != 0


def test_dense_freezes_and_merged_does_not():
    w = randn(0, (3, 4))
    lora = LoraArray.from_factors(w, randn(1, (3, 1)), randn(2, (1, 4)))
    np.testing.assert_allclose(lora.dense(), lora.merged())
    np.testing.assert_allclose(lora.merged(), w + lora.a @ lora.b, rtol=1e-6)
    grad_dense = jax.grad(lambda w: jnp.sum(lora.with_factors(w, lora.a, lora.b).dense()))(w)
    grad_merged = jax.grad(lambda w: jnp.sum(lora.with_factors(w, lora.a, lora.b).merged()))(w)
    assert not np.any(grad_dense) and np.all(grad_merged == 1)
    with pytest.raises(ValueError, match="from_factors"):
        LoraArray.from_factors(w, randn(1, (3, 2)), randn(2, (1, 4)))
