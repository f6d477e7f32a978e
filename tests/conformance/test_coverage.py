"""Does the conformance table cover every primitive JAX defines?

`_enumerate.py` lists every `jax.extend.core.Primitive` object in `jax.lax`,
`jax.extend` and `jax._src` (in a subprocess). Each must either be reached by a row
of the table or be listed in `_exclusions.EXCLUDED` with a reason. A row "reaches"
the primitives named in its `prims`, and that claim is checked here: each must
appear in the row's jaxpr, and must have been handed to the pass-through Value's
`default` with a Value among its operands during the session's runs of the table
(test_values_all, or here when that did not run), unless it takes no array operand
or a core rule handles it (higher-order primitives, sharding annotations).
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from _enumerate import primitive_locations
from _exclusions import EXCLUDED, IGNORED_LOCATIONS
from _inputs import Case
from _table import CASES, RAN, REACHED, run_with_values, split_static

import quaxlike


# Which primitives a JAX release defines, and which each row's jaxpr shows, change
# between releases (0.12 adds high-level primitives such as `call_hi_primitive`
# and routes `closed_call` through `eval_jaxpr`). The table's claims and
# exclusions are kept for the JAX series the main suite runs on; on other
# releases its rows still run (test_conformance), but these two checks do not.
_TABLE_SERIES = (0, 10)
_ON_TABLE_SERIES = tuple(int(p) for p in jax.__version__.split(".")[:2]) == _TABLE_SERIES
_table_series_only = pytest.mark.skipif(
    not _ON_TABLE_SERIES,
    reason=f"the coverage claims are kept for jax {'.'.join(map(str, _TABLE_SERIES))}.x",
)


# Reach the core's trace hooks (`process_call`, `process_custom_*_call`) rather
# than any rule.
_HOOKS = {"call", "closed_call", "custom_jvp_call", "custom_vjp_call"}


def _handled_by_core(primitive) -> bool:
    """Whether quaxlike itself has a rule for `primitive` (higher-order primitives,
    sharding annotations), which takes precedence over a type's `default`."""
    rules = quaxlike.rules_for(primitive)
    return primitive.name in _HOOKS or any(
        rule.implementation.__module__.startswith("quaxlike._") for rule in rules
    )


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _primitives(jaxpr, found: dict) -> dict:
    """`{name: {primitive, ...}}` of every equation in `jaxpr` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        found.setdefault(eqn.primitive.name, set()).add(eqn.primitive)
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                _primitives(sub, found)
    return found


def _plain_primitives(c: Case) -> dict:
    fn, arrays = split_static(c)
    if c.axis_name is None:
        jaxpr = jax.make_jaxpr(fn)(*arrays)
    else:
        size = arrays[0].shape[0]
        jaxpr = jax.make_jaxpr(fn, axis_env=[(c.axis_name, size)])(*(a[0] for a in arrays))
    return _primitives(jaxpr.jaxpr, {})


def _reach(c: Case):
    """(primitives the row reaches, problems with its claims)."""
    if c.name not in RAN:  # test_values_all did not run this row in this session
        run_with_values(c)
    plain = _plain_primitives(c)
    reached, problems = set(), []
    for name in c.prims:
        if name not in plain:
            problems.append(f"{c.name}: claims {name!r}, not in its jaxpr {sorted(plain)}")
        elif (
            plain[name] & REACHED
            or name in c.valueless
            or "values" in c.xfail
            or any(map(_handled_by_core, plain[name]))
        ):
            reached |= plain[name]
        else:
            problems.append(f"{c.name}: {name!r} never reached a Value's default")
    return reached, problems


@pytest.fixture(scope="module")
def reached():
    """`(primitives reached by some row, problems)`, over the whole table."""
    primitives, problems = set(), []
    with jax.check_tracer_leaks(False):
        for c in CASES:
            for name in c.valueless:
                assert name in c.prims, f"{c.name}: valueless {name!r} is not in prims"
            try:
                row_primitives, row_problems = _reach(c)
            except Exception as error:
                problems.append(f"{c.name}: failed: {type(error).__name__}: {error}")
                continue
            primitives |= row_primitives
            problems += row_problems
    return primitives, problems


@_table_series_only
def test_rows_reach_their_primitives(reached):
    _, problems = reached
    assert not problems, "\n".join(problems)


def _enumerate_primitives() -> list[dict]:
    script = Path(__file__).with_name("_enumerate.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(result.stdout)


def _exclusion_for(locations: list[str]):
    """The `EXCLUDED` key that covers a primitive found at `locations`, or None."""
    relevant = [loc for loc in locations if not loc.startswith(IGNORED_LOCATIONS)]
    for key in EXCLUDED:
        if key.endswith("."):
            if relevant and all(loc.startswith(key) for loc in relevant):
                return key
        elif key in locations:
            return key
    return None


@_table_series_only
def test_every_primitive_is_covered_or_excluded(reached, report_coverage):
    entries = _enumerate_primitives()
    # Where the primitives the rows reach live, to match them with the entries.
    reached, _ = reached
    jax_modules = [name for name in sys.modules if name == "jax" or name.startswith("jax.")]
    located = primitive_locations(jax_modules, import_modules=False)
    reached_locations = set()
    for prim in reached:
        reached_locations |= located.get(id(prim), (None, set()))[1]

    covered, excluded, missing, both = [], [], [], []
    used_keys = set()
    for entry in entries:
        is_covered = bool(reached_locations.intersection(entry["locations"]))
        key = _exclusion_for(entry["locations"])
        if key is not None:
            used_keys.add(key)
        if is_covered and key is not None and not key.endswith("."):
            both.append(f"{entry['name']} ({key})")
        elif is_covered:  # (a family exclusion does not stop a row covering a member)
            covered.append(entry["name"])
        elif key is not None:
            excluded.append(entry["name"])
        else:
            missing.append(f"{entry['name']} at {entry['locations'][0]}")
    stale = sorted(set(EXCLUDED) - used_keys)
    report_coverage(
        f"{len(covered)} of {len(entries)} JAX primitives are reached by the "
        f"{len(CASES)}-row conformance table; {len(excluded)} are excluded with a reason "
        f"(tests/conformance/_exclusions.py); {len(missing)} are neither."
    )
    assert not missing, "primitives neither in the table nor excluded:\n" + "\n".join(missing)
    assert not both, "excluded primitives the table covers (drop the exclusion):\n" + "\n".join(
        both
    )
    assert not stale, f"exclusions that match no primitive: {stale}"
