"""The tracer and trace that carry Values through a JAX program.

`QuaxTracer` wraps one `Value` and presents its `aval()` to JAX, so user code
sees an ordinary array. Every operation that reaches `QuaxTrace` takes the same
path, as in Autodidax's interpreter:

1. *open* (`_open`): take over the tracers of adopted traces, and unwrap this
   trace's tracers into their Values; an operation with none of them is the
   parent trace's business and leaves at once (eagerly, a `jit` on plain
   arrays leaves through one compiled call, `_sub_programs.run_compiled`;
   where a type tracks values known while tracing, `_known_values` notes how
   to compute its outputs).
2. *plan* (`plan_for`): the rule registry's plan for these argument kinds,
   looked up once per operation.
3. *shortcut* (only for a rule that owns shortcuts, the `jit`/`closed_call`
   rule of `_higher_order/_jit.py`, and only where `_staging.shortcuts_apply`
   allows): the rule's own shortcut may answer for it.
4. *dispatch* (`_dispatch`): apply the plan under the parent trace, recording
   it under `explain`.
5. *wrap*: Values in the result become tracers again; checked mode compares
   the result with the primitive's abstract evaluation.

The custom-derivative and `shard_map` hooks open and dispatch the same way, on
`custom_jvp_call_p`, `custom_vjp_call_p` and `shard_map_p`, so a type can
register its own rule for them; the built-in rules live in `_higher_order`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _concrete, _instrument, _jax_compat as jc, _known_values
from ._diagnostics import messages, QuaxlikeError, rule_location, rule_name
from ._rules import dispatch_kind, Plan, plan_for
from ._staging import shortcuts_apply
from ._sub_programs import run_compiled
from ._values import checked_aval, describe, is_value, Value


class QuaxTracer(jc.Tracer):
    # Before jax 0.10 the base class has no `aval` slot: the subclass holds it.
    __slots__ = ("value", "aval") if jc.TRACER_NEEDS_AVAL_SLOT else ("value",)

    def __init__(self, trace: "QuaxTrace", value: Value):
        aval = checked_aval(value)  # raises, naming the type, if it is no aval
        if jc.tracking_varying_axes():
            aval = jc.with_varying_axes_of(aval, jax.tree_util.tree_leaves(value))
        jc.init_tracer(self, trace, aval)
        self.value = value

    def full_lower(self):
        return self

    def to_concrete_value(self):
        # JAX's concreteness question (`concrete_or_error`, `bool(x)`, `x.item()`):
        # answered with the array the Value stands for where it is known.
        return _concrete.concrete_value(self._trace.parent_trace, self.value, self.aval)

    def __array__(self, *args, **kwargs):  # pyright: ignore[reportIncompatibleMethodOverride]
        # NumPy's conversion (`x[mask]` takes `np.where(np.asarray(mask))` once
        # JAX has found the mask concrete): the concrete array's, else JAX's error.
        concrete = self.to_concrete_value()
        if concrete is None:
            return super().__array__(*args, **kwargs)
        return np.asarray(concrete).__array__(*args, **kwargs)

    def __repr__(self):
        return f"QuaxTracer<{type(self.value).__qualname__}: {self.aval.str_short()}>"


jc.register_tracer_class(QuaxTracer)


class QuaxTrace(jc.Trace):
    """One `quaxify` call's trace. Its parent is whatever trace was current when
    the call began (another `QuaxTrace`, a jit/grad/vmap trace, or eager).

    `adopts` lists enclosing QuaxTraces whose tracers this one takes over as its
    own when they reach it. Only the body of a `shard_map` needs that: the body
    runs under JAX's own trace, between this trace and the one that lifted a
    Value the body closes over.
    """

    def __init__(self, parent_trace, adopts: tuple["QuaxTrace", ...] = ()):
        super().__init__()
        self.parent_trace = parent_trace
        self.adopts = adopts
        # `explain` records every rule as it runs: no shortcut may skip one.
        self.observing = _instrument.recorder.get() is not None
        # Checked mode compares each result with the primitive's abstract
        # evaluation; it takes the same paths as an unchecked trace.
        self.checking = _instrument.checking.get()
        self.eager = jc.is_eager(parent_trace)

    # --- lift ------------------------------------------------------------------

    def lift(self, value: Value) -> QuaxTracer:
        return QuaxTracer(self, value)

    def owns(self, x: Any) -> bool:
        return type(x) is QuaxTracer and x._trace is self

    def unwrap(self, x: Any) -> Any:
        return x.value if type(x) is QuaxTracer and x._trace is self else x

    def _open(self, tracers) -> tuple[Any, list | None]:
        """`(tracers, values)`: the tracers, with those of adopted traces taken
        over, and the same list with this trace's tracers unwrapped into their
        Values, or `None` when there are none (then the operation is not this
        trace's business)."""
        if self.adopts:
            with jc.set_current_trace(self.parent_trace):  # `aval()` may bind primitives
                tracers = [
                    QuaxTracer(self, t.value)
                    if type(t) is QuaxTracer and any(t._trace is outer for outer in self.adopts)
                    else t
                    for t in tracers
                ]
        for t in tracers:
            if type(t) is QuaxTracer and t._trace is self:
                values = [
                    x.value if type(x) is QuaxTracer and x._trace is self else x for x in tracers
                ]
                return tracers, values
        return tracers, None

    # --- dispatch ----------------------------------------------------------------

    def apply_plan(self, primitive, plan: Plan, tracers, values, kinds, params):
        """Steps 3 to 5 for `primitive` on `tracers` (opened into `values`, of
        `dispatch_kind`s `kinds`), whose plan is `plan`. (Also where the `jit`
        shortcut's `inline` hands an equation whose plan it already has.)"""
        if plan.shortcut is not None and shortcuts_apply(self.observing):
            out = plan.shortcut(self, primitive, plan, tracers, values, kinds, params)
            if out is not NotImplemented:
                if self.checking:
                    self._check(primitive, tracers, params, out, plan.rule)
                return out
        return self._dispatch(primitive, plan, tracers, values, params)

    def _dispatch(self, primitive, plan: Plan, tracers, values, params, wrap=None):
        """Apply `plan` under the parent trace, as rules run, and wrap what it
        returns with `wrap(out, primitive, rule)` (`_wrap_outputs` unless
        given), recording it under `explain` and checking it in checked mode."""
        recorder = _instrument.recorder.get() if self.observing else None
        record = (
            recorder.open(primitive.name, tuple(map(describe, values)))
            if recorder is not None
            else None
        )
        try:
            with jc.set_current_trace(self.parent_trace):
                out, rule = plan.apply(
                    primitive, tuple(values), params, name_scopes=record is not None
                )
                # Wrapped where the rule ran: a Value's `aval()` is user code
                # and may bind primitives (`lax.stop_gradient`) on its leaves.
                outputs = (wrap or self._wrap_outputs)(out, primitive, rule)
        finally:
            if record is not None:
                recorder.close(record)  # pyright: ignore[reportOptionalMemberAccess]
        if record is not None:
            if rule is not None:
                record.rule = rule_name(rule)
                record.location = rule_location(rule)
            else:
                record.default_owner = plan.default_name
        if self.checking and wrap is None:
            self._check(primitive, tracers, params, outputs, rule)
        return outputs

    def _check(self, primitive, tracers, params, outputs, rule) -> None:
        out_list = outputs if primitive.multiple_results else [outputs]
        _instrument.check_outputs(
            primitive,
            [jax.typeof(t) for t in tracers],
            params,
            [jax.typeof(o) for o in out_list],
            rule,
        )

    # --- wrap --------------------------------------------------------------------

    def _wrap_output(self, x: Any, primitive, rule) -> Any:
        if is_value(x):
            return QuaxTracer(self, x)
        if isinstance(x, (jax.Array, jc.Tracer)) or (jc.Ref and isinstance(x, jc.Ref)):
            return x
        try:
            with jc.set_current_trace(self.parent_trace):
                return jnp.asarray(x)
        except TypeError:
            raise QuaxlikeError(
                messages.RULE_RETURNED_NON_ARRAY.format(
                    rule=rule_name(rule), primitive=primitive.name, got=type(x).__qualname__
                )
            ) from None

    def _wrap_outputs(self, out, primitive, rule):
        is_sequence = isinstance(out, (list, tuple))
        if is_sequence != bool(primitive.multiple_results):
            message = (
                messages.RULE_RETURNED_SINGLE
                if primitive.multiple_results
                else messages.RULE_RETURNED_SEQUENCE
            )
            got = type(out).__qualname__
            raise QuaxlikeError(
                message.format(rule=rule_name(rule), primitive=primitive.name, got=got)
            )
        if is_sequence:
            return [self._wrap_output(x, primitive, rule) for x in out]
        return self._wrap_output(out, primitive, rule)

    # --- the hooks JAX calls -----------------------------------------------------

    def process_primitive(self, primitive, tracers, params):
        tracers, values = self._open(tracers)
        if values is None:
            if self.eager and primitive is jc.jit_p:
                # A `jax.numpy` call on plain arrays inside eager quaxified code:
                # JAX took its Python path only because this trace is current.
                with jc.set_current_trace(self.parent_trace):
                    return run_compiled(tracers, params)
            # The parent trace's `process_primitive` directly: `Primitive.bind`
            # made its checks on the way here, with these arguments and params.
            out = self.parent_trace.process_primitive(primitive, tracers, params)
            if _known_values.tracking():
                # A type asked which plain values are constants in disguise.
                _known_values.remember(primitive, tracers, params, out)
            return out
        kinds = tuple(map(dispatch_kind, values))
        plan = plan_for(primitive, values, kinds)
        return self.apply_plan(primitive, plan, tracers, values, kinds, params)

    def process_call(self, call_primitive, f, tracers, params):
        tracers, values = self._open(tracers)
        if values is None:
            with jc.set_current_trace(self.parent_trace):
                return call_primitive.bind(f, *tracers, **params)
        # Inline the call: its body runs under this trace.
        with jc.set_current_trace(self):
            return f.call_wrapped(*tracers)

    # The custom-derivative hooks dispatch on their primitive like any other
    # operation, with JAX's functions as params (see `_higher_order/_custom_ad`).
    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, *, symbolic_zeros, **_):
        tracers, values = self._open(tracers)
        if values is None:
            return self.parent_trace.process_custom_jvp_call(
                primitive, fun, jvp, tracers, symbolic_zeros=symbolic_zeros
            )
        params = dict(fun=fun, jvp=jvp, symbolic_zeros=symbolic_zeros)
        return self._dispatch(primitive, plan_for(primitive, values), tracers, values, params)

    def process_custom_vjp_call(
        self, primitive, fun, fwd, bwd, tracers, out_trees=None, symbolic_zeros=False, **_
    ):
        tracers, values = self._open(tracers)
        options = dict(out_trees=out_trees, symbolic_zeros=symbolic_zeros)
        if values is None:
            return self.parent_trace.process_custom_vjp_call(
                primitive, fun, fwd, bwd, tracers, **options
            )
        params = dict(fun=fun, fwd=fwd, bwd=bwd, **options)
        return self._dispatch(primitive, plan_for(primitive, values), tracers, values, params)

    def process_shard_map(self, primitive, fun, args, **params):
        args, values = self._open(args)
        # Dispatched even with no Value among the arguments: the mapped function
        # may close over Values of this trace. The params are JAX's, plus `fun`
        # (the mapped function) and `outer_trace` (this trace). The result is
        # not checked against `shard_map_p`'s abstract evaluation, which needs
        # the body's jaxpr where the hook has only the function (the body's
        # own operations are checked in its trace).
        values = list(args) if values is None else values
        params = dict(params, fun=fun, outer_trace=self)

        def wrap(out, primitive, rule):
            return jc.map_shard_map_result(out, lambda x: self._wrap_output(x, primitive, rule))

        plan = plan_for(primitive, values)
        return self._dispatch(primitive, plan, args, values, params, wrap=wrap)

    def stage_value(self, val):
        if self.owns(val):
            return val
        staged = self.parent_trace.stage_value(val)
        if _known_values.tracking():  # a constant JAX stages (`lax.full`'s fill)
            _known_values.sharing_knowledge([staged], _known_values.knowledge_of([val]))
        return staged
