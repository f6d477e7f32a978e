"""`qlora`: a LoRA update on every quantised `eqx.nn.Linear` weight of a model."""

from typing import Any

from jaxtyping import PRNGKeyArray, PyTree

from ..quantized import quantize
from ..quantized._value import DEFAULT_BLOCK_BYTES
from ..selection import select
from ._model import loraify


def qlora(
    model: PyTree,
    *,
    rank: int,
    key: PRNGKeyArray,
    bits: int | str = 4,
    group_size: int | None = None,
    double_quant: bool = False,
    scale: float = 0.01,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    where: Any = None,
    dora: bool = False,
    magnitude_from: PyTree | None = None,
) -> PyTree:
    """Quantise every `eqx.nn.Linear` weight of `model` and give it a trainable
    low-rank update: QLoRA.

    The same as `loraify(quantize(model, bits=bits, ...), rank=rank, key=key)`:
    each weight becomes a `LoraArray` whose frozen base is an `Int4Array` (or
    `Int8Array`, or with `bits="nf4"` an `NF4Array`, as in the QLoRA paper).
    Products with it run on the quantised base (on CPU block by block, never
    dequantised whole; see `default_matmul`) plus the low-rank update; gradients
    stop at the base. `where` selects other weights, as for `loraify` and
    `quantize` (both get the same selection).

    **Arguments:**

    - `model`: any PyTree holding `eqx.nn.Linear` layers.
    - `rank`, `key`, `scale`: as for `loraify`.
    - `bits`, `group_size`, `double_quant`, `block_bytes`: as for
        `quaxlike.quantized.quantize` (the paper's setting is
        `bits="nf4", double_quant=True`, groups of 64).
    - `dora`: make DoRA weights over the quantised bases (QDoRA): `DoraArray`s
        whose magnitude starts at the row norms of the dequantised weight, as
        PEFT's does.
    - `magnitude_from`: with `dora=True`, take the initial magnitudes from the
        weights of this tree instead (pass `model` itself for Answer.AI's QDoRA,
        which starts from the weight before quantisation).
    - `where`: which weights, in any form of `quaxlike.selection` (by
        default every `eqx.nn.Linear` weight); check it with `select(model, where)`.

    **Returns:**

    The model with LoRA weights over quantised bases. Train it as any LoRA model
    (`partition` splits off the factors); call it as `quaxlike.quaxify(model)(x)`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jr.key(0))
        model = qlora(mlp, rank=4, key=jr.key(1))
        assert type(model.layers[0].weight.w).__name__ == "Int4Array"
        y = quaxlike.quaxify(model)(jnp.ones(64))
        qdora = qlora(mlp, rank=4, key=jr.key(1), bits="nf4", dora=True, magnitude_from=mlp)
        ```
    """
    quantized = quantize(
        model,
        bits=bits,
        group_size=group_size,
        double_quant=double_quant,
        block_bytes=block_bytes,
        where=where,
    )
    if where is not None:
        # The same leaves, whatever the selection would make of the quantised ones.
        chosen = set(select(model, where))
        where = lambda p, _: p in chosen  # noqa: E731
    return loraify(
        quantized,
        rank=rank,
        key=key,
        scale=scale,
        where=where,
        dora=dora,
        magnitude_from=magnitude_from,
    )
