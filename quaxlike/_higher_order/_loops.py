"""`while` (`lax.while_loop`, `fori_loop` with traced bounds) and `scan`
(`lax.scan`, `fori_loop` with static bounds, `lax.map`)."""

import dataclasses
import functools as ft
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from .. import _jax_compat as jc
from .._diagnostics import (
    CarryChangedError,
    CarryMaterialisationError,
    MaterialisationError,
    messages,
    QuaxlikeError,
)
from .._known_values_across import LoopCarries
from .._quaxify import lifted_call
from .._rules import register
from .._values import checked_aval, describe, Value
from ._branch_callbacks import abstract_template
from ._common import AnyValue, to_dense, to_dense_or_raise, type_signature
from ._joins import join_side, joined_template, same_structure


@dataclasses.dataclass
class _CarryPlan:
    """What to do with the carries whose type the body changes: `dense` maps the
    positions to materialise, and `joins` those where a plain array meets a Value
    (`_joins`), to how they changed (their descriptions on entry, as the body
    returns them); `joins` also holds the template of the joined type, and
    `declined` the joins whose type did not hold the plain array on this try."""

    dense: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    joins: dict[int, tuple[Value, tuple[str, str]]] = dataclasses.field(default_factory=dict)
    declined: set[int] = dataclasses.field(default_factory=set)
    # Plain carries entering as stand-ins (`Value.stand_in_for_plain`), on a try
    # that finds their types.
    stand_ins: dict[int, Value] = dataclasses.field(default_factory=dict)

    def materialise_instead(self, i: int) -> None:
        """Carry `i`, planned as a join, materialised instead."""
        _, change = self.joins.pop(i)
        self.dense[i] = change


def _run_with_carry_fallback(primitive, init, run, operands):
    """Call `run(plan, record)`, where `plan` (a `_CarryPlan`) says which carry
    positions to join or materialise.

    A loop body may change the type of a carry (a symbolic zero becoming dense, a
    state that starts as plain zeros becoming a Value). `run` records the
    signature of the carry the body returns; if JAX rejects the loop, the
    positions that changed are joined where a plain array meets a Value whose
    type holds it, else materialised, and the loop retraced. If the body itself
    raises an error of ours (kept by `_catching`), plain carries may enter as
    stand-ins offered by the loop's `operands` (`Value.stand_in_for_plain`) to
    find their types; else that error is raised.
    """
    plan = _CarryPlan()
    # A plain carry that a Value of the loop could hold as a Value of its own
    # (a zero state beside a banded matrix) is tried as that Value first: the
    # body may otherwise materialise the Value, where it may, before anything
    # is refused. Kept only where the body returns it as that type.
    plan.joins.update(_joins_found_by_stand_ins(run, plan, init, operands, held_only=True)[0])
    for _ in range(3 * len(init) + 2):
        record: dict = {}
        try:
            return run(plan, record)
        except QuaxlikeError:
            raise  # ours, from outside the body (which keeps its own): not JAX's
        except (TypeError, ValueError):
            body_error = record.get("body_error")
            if body_error is not None:
                # Ours, from inside the body: not JAX rejecting the carry. Perhaps
                # a plain carry the body would accept as a Value (one found may
                # show the next: a sum of products of it).
                joins, error_with_stand_ins = _joins_found_by_stand_ins(run, plan, init, operands)
                if not joins:
                    # With its plain carries standing in, the body may fail further
                    # on: that error is the one to fix, not what plain carries did.
                    error = error_with_stand_ins or body_error
                    error.__suppress_context__ = True  # not JAX's carry check
                    raise error
                plan.joins.update(joins)
                continue
            if plan.declined:  # a type did not hold the plain array: materialise there
                for i in plan.declined:
                    plan.materialise_instead(i)
                plan.declined.clear()
                continue
            out_types = record.get("carry_out")
            if out_types is None:
                raise
            in_types = record["carry_in"]
            changed = {i for i, (a, b) in enumerate(zip(in_types, out_types)) if a != b}
            if not changed:
                raise
            if changed <= plan.dense.keys():
                i = min(changed)
                before, after = _change(record, i)
                raise CarryChangedError(
                    messages.CARRY_TYPE_CHANGED.format(
                        primitive=primitive.name, index=i, before=before, after=after
                    )
                ) from None
            for i in changed - plan.dense.keys():
                if i in plan.joins:  # joined, and still not one type: materialise
                    plan.materialise_instead(i)
                elif (template := _join_template(record, i)) is not None:
                    plan.joins[i] = (template, _change(record, i))
                else:
                    plan.dense[i] = _change(record, i)
    raise AssertionError("unreachable")


def _catching(record: dict, body, rejected):
    """`body`, except that an error of ours raised while JAX traces it is kept in
    `record["body_error"]` and `rejected(*args)` returned instead: a carry of
    another structure, which JAX rejects once the body's trace has ended, so that
    `_run_with_carry_fallback` raises the error outside it. (An error raised
    through JAX's tracing leaves that trace's tracers alive for good: JAX
    releases them only when the trace returns.) The kept error has no traceback,
    which would hold the body's tracers (`without_traced_frames`)."""

    def traced(*args):
        try:
            return body(*args)
        except QuaxlikeError as error:
            record["body_error"] = jc.without_traced_frames(error)
            return rejected(*args)

    return traced


def _joins_found_by_stand_ins(
    run, plan: _CarryPlan, init, operands, held_only: bool = False
) -> tuple[dict, Any]:
    """Trace the loop once with each plain carry replaced by the stand-in that a
    Value among `operands` offers for it, and return, for each carry the body
    gave a Value of another structure, the join to plan (`_CarryPlan.joins`),
    and the error of ours the body raised with the stand-ins, if it did. The
    trace's results are dropped. With `held_only`, only stand-ins that hold the
    carry as it is (not `standing_in()`) are offered."""
    stand_ins: dict[int, Value] = {}
    offering = {type(v): v for v in operands if isinstance(v, Value)}.values()
    for i, x in enumerate(init):
        if isinstance(x, Value) or i in plan.joins or i in plan.dense:
            continue
        offers = (value.stand_in_for_plain(x) for value in offering)
        stand_in = next((offer for offer in offers if offer is not None), None)
        if stand_in is not None and not (held_only and stand_in.standing_in()):
            stand_ins[i] = stand_in
    if not stand_ins:
        return {}, None
    trial = dataclasses.replace(
        plan, dense=dict(plan.dense), joins=dict(plan.joins), declined=set(), stand_ins=stand_ins
    )
    record: dict = {}
    try:
        run(trial, record)
    except (TypeError, ValueError):
        pass  # JAX rejects the changed carries; only what the body returned matters
    out_templates = record.get("carry_out_templates")
    if out_templates is None or "body_error" in record:  # failed with stand-ins too
        return {}, record.get("body_error")
    joins = {}
    for i, stand_in in stand_ins.items():
        out = out_templates[i]
        if out is None or (
            stand_in.standing_in() and same_structure(out, abstract_template(stand_in))
        ):
            continue  # the body gave the carry no type of its own: it stays plain
        template = joined_template([out])
        if template is not None:
            joins[i] = (template, (describe(init[i]), record["carry_out_text"][i]))
    return joins, None


def _join_template(record: dict, i: int) -> Value | None:
    """Where carry `i` is a Value on entry or as the body returns it (or both, in
    forms that join): the template both sides are held in."""
    return joined_template([record["carry_in_templates"][i], record["carry_out_templates"][i]])


def _change(record: dict, i: int) -> tuple[str, str]:
    """How carry `i` changed: its descriptions on entry and as the body returns it,
    or its PyTree structures where only static fields (a unit) differ."""
    before, after = record["carry_in_text"][i], record["carry_out_text"][i]
    if before == after:
        before, after = str(record["carry_in"][i][0]), str(record["carry_out"][i][0])
    return before, after


def _entering(init, plan: _CarryPlan, primitive):
    """The carries as they enter the loop on this try: `_densify`d, or stand-ins."""
    carry = _densify(init, plan, primitive)
    return [plan.stand_ins.get(i, v) for i, v in enumerate(carry)]


def _densify(values, plan: _CarryPlan, primitive):
    """`values` with the carries at the positions in `plan.dense` materialised and
    those in `plan.joins` joined; a carry that refuses to be materialised gives a
    `CarryMaterialisationError` saying how it changed."""
    out = []
    for i, v in enumerate(values):
        if i in plan.joins:
            template, _ = plan.joins[i]
            where = f"carry {i} of `{primitive.name}`"
            out.append(join_side(v, template, i, where, plan.declined))
            continue
        if i not in plan.dense:
            out.append(v)
            continue
        before, after = plan.dense[i]
        out.append(
            to_dense_or_raise(
                v,
                primitive,
                CarryMaterialisationError,
                messages.CARRY_REFUSED,
                primitive=primitive.name,
                index=i,
                before=before,
                after=after,
                type_name=type(v).__name__,
            )
        )
    return out


def _plain(values) -> list:
    """`values` with each Value as `None`: the plain carries, for `LoopCarries`."""
    return [None if isinstance(v, Value) else v for v in values]


def _record(record, key, values):
    record[key] = [type_signature(v) for v in values]
    record[key + "_text"] = [_described(v) for v in values]
    record[key + "_templates"] = [
        abstract_template(v) if isinstance(v, Value) else None for v in values
    ]


def _described(value) -> str:
    """`describe(value)`, with the static fields of a Value (its unit, its axis
    names), which a carry must keep too."""
    text = describe(value)
    if isinstance(value, Value) and dataclasses.is_dataclass(value):
        static = [
            f"{field.name}={getattr(value, field.name, '?')}"
            for field in dataclasses.fields(value)
            if field.metadata.get("static")
        ]
        if static:
            text += f" ({', '.join(static)})"
    return text


def _keep_where_false(predicate, new, old):
    """`new` where `predicate` holds, else `old`; `predicate`'s shape is a prefix
    of theirs. Dispatched, so a carry type with a `select_n` rule keeps its type."""

    def select(p, n, o):
        p = lax.broadcast_in_dim(p, jax.numpy.shape(n), tuple(range(p.ndim)))
        return lax.select(p, n, o)

    return lifted_call(select, predicate, new, old)


def _dense_predicate(predicate, aval):
    """A loop predicate as a boolean array: materialised if it is a Value.

    A Value whose `materialise()` is not implemented (raises
    `NotImplementedError`, as Quax's test type `MyArray` does) but that wraps
    exactly one array of the predicate's shape and dtype gives that array, as
    Quax's `while` rule always does. Any other refusal is deliberate (a secret
    that must not decide a loop, say) and is raised, naming `while`.
    """
    if not isinstance(predicate, Value):
        return predicate
    try:
        return to_dense(predicate, jc.while_p)
    except MaterialisationError as error:
        if not isinstance(error.__cause__, NotImplementedError):
            raise
        leaves = [leaf for leaf in jtu.tree_leaves(predicate) if eqx.is_array(leaf)]
        if len(leaves) == 1:
            leaf_aval = jax.typeof(leaves[0])
            if (leaf_aval.shape, leaf_aval.dtype) == (aval.shape, aval.dtype):
                return leaves[0]
        raise


@register(jc.while_p)
def while_p_values(
    *args: AnyValue, cond_nconsts: int, cond_jaxpr, body_nconsts: int, body_jaxpr, **params
):
    cond_consts = args[:cond_nconsts]
    body_consts = args[cond_nconsts : cond_nconsts + body_nconsts]
    init = list(args[cond_nconsts + body_nconsts :])
    cond_fun = ft.partial(lifted_call, jc.jaxpr_as_fun(cond_jaxpr))
    body_fun = ft.partial(lifted_call, jc.jaxpr_as_fun(body_jaxpr))
    # vmap of a loop whose predicate depends on the mapped data gives a `while`
    # with one predicate per element: it runs while any holds, and elements whose
    # predicate is false keep their carry (what XLA's lowering of it does).
    batched_predicate = bool(cond_jaxpr.out_avals[0].shape)

    def predicate_of(c):
        (predicate,) = cond_fun(*cond_consts, *c)
        return _dense_predicate(predicate, cond_jaxpr.out_avals[0])

    def run(plan, record):
        carry = _entering(init, plan, jc.while_p)
        _record(record, "carry_in", carry)
        known = LoopCarries(_plain(carry))

        def cond(c):
            predicate = predicate_of(c)
            if batched_predicate:
                predicate = lax.reduce_or(predicate, tuple(range(predicate.ndim)))
            return predicate

        def body(c):
            known.entering(c)
            out = body_fun(*body_consts, *c)
            if batched_predicate:
                predicate = predicate_of(c)
                out = [_keep_where_false(predicate, n, o) for n, o in zip(out, c)]
            out = _densify(out, plan, jc.while_p)
            _record(record, "carry_out", out)
            known.leaving(_plain(out))
            return out

        rejected = lambda c: [*c, jnp.zeros((), bool)]  # noqa: E731
        out = lax.while_loop(cond, _catching(record, body, rejected), carry)
        known.exiting(_plain(out))
        return out

    return _run_with_carry_fallback(jc.while_p, init, run, args)


# --- scan ---------------------------------------------------------------------


def _aval_of_leaves(value: Value, leaf_shapes) -> jc.AbstractValue | None:
    """The aval `value` would have with its array leaves replaced by arrays of the
    given shapes (computed abstractly); None when `aval()` fails on them."""
    leaves, treedef = jtu.tree_flatten(value)
    found = []

    def probe(*array_leaves):
        it = iter(array_leaves)
        rebuilt = [next(it) if eqx.is_array(leaf) else leaf for leaf in leaves]
        found.append(checked_aval(jtu.tree_unflatten(treedef, rebuilt)))
        return ()

    structs = [
        jax.ShapeDtypeStruct(shape, leaf.dtype)
        for leaf, shape in zip([leaf for leaf in leaves if eqx.is_array(leaf)], leaf_shapes)
    ]
    try:
        jax.eval_shape(probe, *structs)
    except Exception:
        return None
    return found[0]


def _array_leaves(value):
    return [leaf for leaf in jtu.tree_leaves(value) if eqx.is_array(leaf)]


def _scans_by_leaves(value: Value, length: int) -> bool:
    """Whether slicing `value`'s leaves along axis 0 gives a Value of the sliced
    shape (a stacked LoRA does; a `Zero` with no leaves does not)."""
    leaves = _array_leaves(value)
    if not leaves or any(leaf.ndim == 0 or leaf.shape[0] != length for leaf in leaves):
        return False
    # A scanned Value stands for an array: its avals are `ShapedArray`s.
    step = cast(
        "jc.ShapedArray | None", _aval_of_leaves(value, [leaf.shape[1:] for leaf in leaves])
    )
    full = cast(jc.ShapedArray, checked_aval(value))
    return step is not None and step.shape == full.shape[1:] and step.dtype == full.dtype


def _stacks_by_leaves(value: Value, length: int) -> bool:
    """Whether stacking `value`'s leaves gives a Value of the stacked shape."""
    leaves = _array_leaves(value)
    if not leaves:
        return False
    stacked = cast(
        "jc.ShapedArray | None", _aval_of_leaves(value, [(length, *leaf.shape) for leaf in leaves])
    )
    step = cast(jc.ShapedArray, checked_aval(value))
    return (
        stacked is not None
        and stacked.shape == (length, *step.shape)
        and stacked.dtype == step.dtype
    )


@register(jc.scan_p)
def scan_p_values(*args: AnyValue, reverse: bool, length: int, jaxpr, unroll=1, **params):
    num_consts, num_carry = jc.scan_layout(params)
    consts = args[:num_consts]
    init = list(args[num_consts : num_consts + num_carry])
    xs = [
        to_dense(x, jc.scan_p) if isinstance(x, Value) and not _scans_by_leaves(x, length) else x
        for x in args[num_consts + num_carry :]
    ]
    body_fun = ft.partial(lifted_call, jc.jaxpr_as_fun(jaxpr))

    def run(plan, record):
        carry = _entering(init, plan, jc.scan_p)
        _record(record, "carry_in", carry)
        known = LoopCarries(_plain(carry), _plain(xs))

        def body(c, x):
            known.entering(c, x)
            out = body_fun(*consts, *c, *x)
            carry_out = _densify(out[:num_carry], plan, jc.scan_p)
            _record(record, "carry_out", carry_out)
            ys = [
                to_dense(y, jc.scan_p)
                if isinstance(y, Value) and not _stacks_by_leaves(y, length)
                else y
                for y in out[num_carry:]
            ]
            known.leaving(_plain(carry_out), _plain(ys))
            return carry_out, ys

        rejected = lambda c, x: ([*c, jnp.zeros((), bool)], [])  # noqa: E731
        traced = _catching(record, body, rejected)
        carry_out, ys = lax.scan(traced, carry, xs, length=length, reverse=reverse, unroll=unroll)
        known.exiting(_plain(carry_out), _plain(ys))
        return [*carry_out, *ys]

    return _run_with_carry_fallback(jc.scan_p, init, run, args)
