"""`quaxlike.internal.output_aval` against `jax.eval_shape` of the same bind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import quaxlike
from quaxlike.internal import output_aval
from quaxlike.symbolic.zero import Zero


CASES = [
    ("add", lambda a, b: a + b, (jnp.ones(3), jnp.ones(3))),
    ("add weak", lambda a: lax.add(a, 2.0), (jnp.ones(3),)),
    ("dot_general", lambda a, b: a @ b, (jnp.ones((2, 3)), jnp.ones((3, 4)))),
    ("reduce_sum", lambda a: a.sum(0), (jnp.ones((2, 3)),)),
    ("convert", lambda a: a.astype(jnp.int8), (jnp.ones(3),)),
    ("split", lambda a: jnp.split(a, [1]), (jnp.ones(3),)),
    ("cumsum", lambda a: lax.cumsum(a), (jnp.ones(3),)),
    (
        "while",
        lambda a: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1]), (0, a)),
        (jnp.ones(2),),
    ),
]


@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
def test_agrees_with_eval_shape(name, fn, args):
    # The last equation `fn` traces: its primitive, params and operand avals.
    eqn = jax.make_jaxpr(fn)(*args).eqns[-1]
    primitive, params = eqn.primitive, eqn.params
    operands = [v.aval for v in eqn.invars]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in operands]
    want = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)
    # Values count as arrays of their aval.
    values = [
        Zero(a.shape, a.dtype) if not a.weak_type else jnp.zeros(a.shape, a.dtype) for a in operands
    ]
    got = output_aval(primitive, values, params)
    want_list = want if primitive.multiple_results else [want]
    got_list = got if primitive.multiple_results else [got]
    assert [(g.shape, g.dtype, g.weak_type) for g in got_list] == [
        (w.shape, w.dtype, w.weak_type) for w in want_list
    ]


def test_operands_that_do_not_fit_raise_jax_s_error():
    params = dict(
        dimension_numbers=(((1,), (0,)), ((), ())),
        precision=None,
        preferred_element_type=jnp.float32,
        out_sharding=None,
    )
    with pytest.raises(TypeError, match="dot_general"):
        output_aval(
            lax.dot_general_p, [Zero((2, 3), jnp.float32), np.ones((4, 5), np.float32)], params
        )


def test_adds_nothing_to_the_traced_program():
    def f(x):
        output_aval(lax.sin_p, [x], dict(accuracy=None))
        return x

    assert not jax.make_jaxpr(f)(jnp.ones(3)).eqns
    assert quaxlike.quaxify(lambda z: z)(Zero((2,), jnp.float32)).shape == (2,)
