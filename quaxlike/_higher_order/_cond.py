"""`cond` (`lax.cond`, `lax.switch`)."""

import functools as ft

from jax import lax

from .. import _jax_compat as jc
from .._diagnostics import BranchMaterialisationError, messages, QuaxlikeError
from .._quaxify import lifted_call
from .._rules import register
from ._common import AnyValue, to_dense, to_dense_or_raise, type_signature


@register(jc.cond_p)
def cond_p_values(index: AnyValue, *operands: AnyValue, branches, **params):
    index = to_dense(index, jc.cond_p)
    bodies = [ft.partial(lifted_call, jc.jaxpr_as_fun(branch)) for branch in branches]
    # Branches may return different types at one position (a symbolic zero in one
    # branch, a dense array in the other). Try as they are; if JAX rejects the
    # branches as mismatched, materialise exactly the positions that disagree.
    dense: set[int] = set()
    while True:
        signatures: list = [None] * len(bodies)

        def make_branch(i):
            def branch(*ops):
                out = bodies[i](*ops)
                out = [_to_dense_output(o, j) if j in dense else o for j, o in enumerate(out)]
                signatures[i] = [type_signature(o) for o in out]
                return out

            return branch

        try:
            return lax.switch(index, [make_branch(i) for i in range(len(bodies))], *operands)
        except QuaxlikeError:
            raise  # ours, from inside a branch: not JAX rejecting the branches' outputs
        except (TypeError, ValueError):
            if any(s is None for s in signatures):
                raise
            first = signatures[0]
            disagree = {
                j for j in range(len(first)) if any(s[j] != first[j] for s in signatures[1:])
            }
            if not disagree - dense:
                raise
            dense |= disagree


def _to_dense_output(value, index: int):
    """Output `index` of a branch, materialised because the branches disagree
    there; a Value that refuses gives a `BranchMaterialisationError`."""
    return to_dense_or_raise(
        value,
        jc.cond_p,
        BranchMaterialisationError,
        messages.BRANCH_REFUSED,
        index=index,
        type_name=type(value).__name__,
    )
