"""`cond` (`lax.cond`, `lax.switch`)."""

import functools as ft

from jax import lax

from .. import _jax_compat as jc
from .._diagnostics import BranchMaterialisationError, messages, QuaxlikeError
from .._known_values import knowledge_of, sharing_knowledge
from .._known_values_across import BranchOutputs
from .._quaxify import lifted_call
from .._rules import register
from .._values import Value
from ._branch_callbacks import abstract_template, callback_outputs, run_retyped
from ._common import AnyValue, to_dense, to_dense_or_raise, type_signature
from ._joins import join_side, joined_template


@register(jc.cond_p)
def cond_p_values(index: AnyValue, *operands: AnyValue, branches, **params):
    index = to_dense(index, jc.cond_p)
    # Branches may return different types at one position (a symbolic zero in one
    # branch, a dense array in the other). Try as they are; if JAX rejects the
    # branches as mismatched, give a host callback's result at such a position
    # the type the other branches agree on (`_branch_callbacks`), where a plain
    # array meets a Value let the Value's type hold it (`_joins`), and
    # materialise the other positions that disagree.
    dense: set[int] = set()
    joins: dict[int, Value] = {}
    retyped: list[dict] = [{} for _ in branches]
    knowledge = knowledge_of(operands)
    while True:
        signatures: list = [None] * len(branches)
        templates: list = [None] * len(branches)
        declined: set[int] = set()
        known = BranchOutputs(len(branches))

        def make_branch(i):
            if retyped[i]:
                body = ft.partial(lifted_call, ft.partial(run_retyped, branches[i], retyped[i]))
            else:
                body = ft.partial(lifted_call, jc.jaxpr_as_fun(branches[i]))

            def branch(*ops):
                sharing_knowledge(ops, knowledge)  # fresh tracers for the operands
                out = body(*ops)
                out = [_to_dense_output(o, j) if j in dense else o for j, o in enumerate(out)]
                out = [
                    join_side(o, joins[j], j, f"output {j} of `cond`", declined)
                    if j in joins
                    else o
                    for j, o in enumerate(out)
                ]
                signatures[i] = [type_signature(o) for o in out]
                templates[i] = [abstract_template(o) if isinstance(o, Value) else None for o in out]
                known.leaving(i, _plain(out))
                return out

            return branch

        try:
            out = lax.switch(index, [make_branch(i) for i in range(len(branches))], *operands)
            known.exiting(_plain(out))
            return out
        except QuaxlikeError:
            raise  # ours, from inside a branch: not JAX rejecting the branches' outputs
        except (TypeError, ValueError):
            if declined:  # a type did not hold the plain array: materialise there
                for j in declined:
                    _materialise_instead(j, joins, dense)
                continue
            if any(s is None for s in signatures):
                raise
            first = signatures[0]
            disagree = {
                j for j in range(len(first)) if any(s[j] != first[j] for s in signatures[1:])
            }
            new = disagree - dense
            if not new:
                raise
            for j in sorted(new):
                if j in joins:  # joined, and still not one type: materialise
                    _materialise_instead(j, joins, dense)
                elif _retype_callbacks(j, branches, signatures, templates, retyped):
                    continue
                elif (template := joined_template([t[j] for t in templates])) is not None:
                    joins[j] = template
                else:
                    dense.add(j)


def _plain(values) -> list:
    """`values` with each Value as `None`, for `BranchOutputs`."""
    return [None if isinstance(v, Value) else v for v in values]


def _materialise_instead(j: int, joins: dict[int, Value], dense: set[int]) -> None:
    """Output `j`, planned as a join, materialised instead."""
    del joins[j]
    dense.add(j)


def _retype_callbacks(j: int, branches, signatures, templates, retyped) -> bool:
    """Give output `j` of the branches that compute it with a host callback the
    Value type the other branches agree on; `False` when they do not agree, or
    when a branch that disagrees computes it otherwise."""
    values = [i for i in range(len(branches)) if templates[i][j] is not None]
    if not values or len({_hashable(signatures[i][j]) for i in values}) != 1:
        return False
    others = [i for i in range(len(branches)) if i not in values]
    if any(j in retyped[i] for i in others):
        return False
    producers = [callback_outputs(branches[i]) for i in others]
    if not all(j in found for found in producers):
        return False
    for i in others:
        retyped[i][j] = templates[values[0]][j]
    return True


def _hashable(signature) -> str:
    return repr(signature)


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
