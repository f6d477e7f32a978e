"""What is known of the plain outputs of a loop or a `cond` whose body a rule
runs on Values (`_higher_order/_loops.py`, `_cond.py`).

Such a rule gives JAX a new loop or `cond`, whose outputs are new tracers, and
hands the body fresh tracers for its carries: nothing known of them would
cross. A loop over plain arrays only reaches the trace as one operation, and
`_known_values` follows its body as a jaxpr (`_invariant_through_body`); here
the same is done where the body runs under `quaxify`:

- `LoopCarries`: a float carry that enters 0, +-inf or NaN everywhere and that
  the body gives back so (a solver's output buffer, which diffrax's loop copies
  at each step and writes after the loop) is so after the loop; the greatest
  fixed point over the carries, by assumptions made in passes (`_passes`).
- `BranchOutputs`: an output that every branch gives 0, +-inf or NaN is so.

Only scale-invariance crosses: the values themselves would need the number of
iterations or the branch taken.
"""

from collections.abc import Sequence
from typing import cast

from . import _jax_compat as jc
from ._known_values import (
    _decision,
    _invariant_of,
    _is_float,
    _knowledge,
    _known,
    _MaybeInvariant,
    _passes,
    _record,
)


class LoopCarries:
    """What is known of a loop's plain carries after the loop: a float carry
    that enters 0, +-inf or NaN everywhere and that the body gives back so (a
    solver's output buffer, copied or written only with such values) is so
    when the loop ends, whatever the number of iterations; and so for what a
    `scan` stacks, where the body gives it so.

    Inside the body a carry is a fresh tracer, nothing known of it. The body's
    carries are noted as invariant under an assumption, and the outputs'
    invariance is the greatest fixed point, worked out when a rule asks: assume
    every carry that enters invariant stays so, drop those the body does not
    give back invariant under that assumption, until none is dropped. By
    induction on the iterations, the carries left are invariant at every one.

    **Arguments:**

    - `init`: the carries as they enter the loop, `None` for a Value.
    - `xs`: what a `scan` slices, `None` for a Value.

    Call `entering` on the body's carries (and slices) before running it,
    `leaving` on what the body returns, `exiting` on the loop's outputs. Does
    nothing unless a table of known values is open.
    """

    def __init__(self, init: list, xs: Sequence = ()):
        self._init = self._xs = None
        if _known.get() is not None:
            self._init = [None if x is None else _knowledge(x) for x in init]
            self._xs = [None if x is None else _knowledge(x) for x in xs]
        self._assumed: frozenset[int] = frozenset()
        self._out: list = []
        self._stacked: list = []
        self._fixed_point = _decision(self._find_fixed_point)

    def entering(self, carries: list, xs: Sequence = ()) -> None:
        known = _known.get()
        if self._init is None or self._xs is None or known is None:
            return
        for i, (x, start) in enumerate(zip(carries, self._init)):
            if start is not None and isinstance(x, jc.Tracer) and _is_float(x):
                _record(known, x, _MaybeInvariant(lambda i=i: i in self._assumed))
        for x, whole in zip(xs, self._xs):  # a slice of an invariant array is so
            if whole is not None and isinstance(x, jc.Tracer) and _is_float(x):
                _record(known, x, _MaybeInvariant(_decision(lambda w=whole: _invariant_of(w))))

    def leaving(self, carries: list, stacked: Sequence = ()) -> None:
        """`carries` as the body returns them, and what a `scan` stacks; `None`
        for a Value."""
        if self._init is not None:
            self._out = [None if x is None else _knowledge(x) for x in carries]
            self._stacked = [None if x is None else _knowledge(x) for x in stacked]

    def exiting(self, carries: list, stacked: Sequence = ()) -> None:
        """The loop's outputs: `carries` after it, and what a `scan` stacked;
        `None` for a Value."""
        known = _known.get()
        if self._init is None or not (self._out or self._stacked) or known is None:
            return
        outputs = [*carries, *stacked]
        ends = [*self._out, *self._stacked]
        for i, (x, end) in enumerate(zip(outputs, ends)):
            if x is not None and end is not None and isinstance(x, jc.Tracer):
                _record(known, x, _MaybeInvariant(lambda i=i: self._fixed_point()[i]))

    def _find_fixed_point(self) -> list[bool]:
        init, out = cast(list, self._init), self._out
        assumed = frozenset(
            i
            for i, (start, end) in enumerate(zip(init, out))
            if start is not None and end is not None and _invariant_of(start)
        )
        while True:
            _passes.append({})
            self._assumed = assumed
            try:
                dropped = {i for i in assumed if not _invariant_of(out[i])}
                stacked = [] if dropped else [_invariant_of(k) for k in self._stacked]
            finally:
                self._assumed = frozenset()
                _passes.pop()
            if not dropped:
                return [i in assumed for i in range(len(out))] + stacked
            assumed = assumed - dropped


class BranchOutputs:
    """What is known of a `cond`'s plain outputs: one that is 0, +-inf or NaN
    everywhere in every branch is so whichever branch runs.

    Call `leaving(i, outputs)` in branch `i` (`None` for a Value), `exiting`
    on the `cond`'s outputs. Does nothing unless a table of known values is
    open.
    """

    def __init__(self, branches: int):
        self._out: list = [None] * branches

    def leaving(self, branch: int, outputs: list) -> None:
        if _known.get() is not None:
            self._out[branch] = [None if x is None else _knowledge(x) for x in outputs]

    def exiting(self, outputs: list) -> None:
        known = _known.get()
        if known is None or any(out is None for out in self._out):
            return
        for j, x in enumerate(outputs):
            if x is None or not isinstance(x, jc.Tracer):
                continue
            sides = [out[j] for out in self._out]
            if any(side is None for side in sides):
                continue
            decide = _decision(lambda sides=sides: all(map(_invariant_of, sides)))
            _record(known, x, _MaybeInvariant(decide))
