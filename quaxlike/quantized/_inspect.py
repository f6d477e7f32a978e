"""Checking a traced program for dense copies of quantised weights."""

import jax.numpy as jnp
import numpy as np

import quaxlike


def _jaxprs(jaxpr):
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            yield from _jaxprs(sub)


def largest_dequantized(jaxpr) -> int:
    """The most elements that any conversion of integers to floating point, or any
    lookup of integer codes in a one-dimensional table of floating-point levels,
    makes in a traced program, sub-programs (loop bodies, `jit`s, `checkpoint`s)
    included.

    Every dequantisation starts by converting integer codes to floating point
    (`Int8Array`, `Int4Array`) or by looking them up in a table of levels
    (`NF4Array`), so this bounds how much of any quantised weight exists in dense
    form at once.
    Compare it with the number of elements of the weights: smaller means that no
    dense copy of a weight was made (quaxlike's products dequantise at most half
    a weight at a time).

    **Arguments:**

    - `jaxpr`: a `jax.make_jaxpr` result (a `ClosedJaxpr`) or a `Jaxpr`.

    **Returns:**

    The largest number of elements, or 0 if the program converts no integers to
    floating point.

    !!! example

        ```python
        w = quantize_int8(jr.normal(jr.key(0), (256, 64)))
        x = jnp.ones((64, 8))
        jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda w, x: w @ x))(w, x)
        assert 0 < largest_dequantized(jaxpr) <= w.size // 2
        ```
    """
    largest = 0
    for sub in _jaxprs(getattr(jaxpr, "jaxpr", jaxpr)):
        for eqn in sub.eqns:
            if eqn.primitive.name == "convert_element_type":
                source, (target,) = eqn.invars[0], eqn.outvars
            elif eqn.primitive.name == "gather" and eqn.invars[0].aval.ndim == 1:
                # A lookup of integer codes in a table of levels (NF4's).
                source, (target,) = eqn.invars[1], eqn.outvars
                if not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
                    continue
            else:
                continue
            if jnp.issubdtype(source.aval.dtype, jnp.integer) and jnp.issubdtype(
                target.aval.dtype, jnp.floating
            ):
                largest = max(largest, int(np.prod(target.aval.shape)))
    return largest
