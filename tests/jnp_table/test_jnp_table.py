"""The type x jax.numpy table: every public function of `jax.numpy`,
`jax.numpy.linalg` and `jax.nn` called with Values of each example type and
compared with plain JAX on the dense arrays (see `_run.py`).

Each column is one test: no cell may be wrong, no cell unclear unless it is a
known core bug, every refusal needs a reason (`_reasons.py`), and the column
must come out as committed in `table.json`, from which the docs page
`docs/supported-functions.md` is generated. After changing a rule, run
`python tests/jnp_table/generate.py` and commit both files.
"""

import jax
import jax.numpy as jnp
import pytest
from _columns import COLUMNS, COLUMNS_BY_NAME
from _data import calls, compute_column, load, PAGE, render_page
from _reasons import KNOWN_CORE_BUGS, reason_for
from _signatures import EXCLUDED, public_functions

import quaxlike
from quaxlike.units import m, UnitError, Unitful


_REGENERATE = "run `python tests/jnp_table/generate.py` and commit table.json and the page"


def test_every_function_is_called_or_excluded():
    missing = [name for name, call in calls().items() if call is None]
    assert not missing, (
        f"no arguments found for {missing}: add an entry to OVERRIDES (or EXCLUDED, with "
        "a reason) in tests/jnp_table/_signatures.py"
    )
    stale = sorted(set(EXCLUDED) - set(public_functions()))
    assert not stale, f"excluded but not public functions of this JAX: {stale}"


def _check_column(name: str, cells: dict) -> None:
    problems = []
    for function, cell in sorted(cells.items()):
        if cell.status == "wrong":
            problems.append(f"{function}: wrong ({cell.detail})")
        elif cell.status == "unclear" and (name, function) not in KNOWN_CORE_BUGS:
            problems.append(f"{function}: unclear ({cell.detail})")
        elif (
            cell.status == "refused" and reason_for(name, function, cell.detail, cell.error) is None
        ):
            problems.append(
                f"{function}: refused at {cell.detail} ({cell.error}) with no reason in "
                "_reasons.py: add a rule, or a sentence saying why not"
            )
    assert not problems, f"column {name}:\n" + "\n".join(problems)


# The columns every run checks: a symbolic type (zero), a low-rank and a
# quantised weight, and a type that refuses what it cannot do (unitful). The
# other nine are slow tests: CI's shards and `--run-slow` run them.
DEFAULT_COLUMNS = ("zero", "lora", "int4", "unitful")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(c.name, marks=[] if c.name in DEFAULT_COLUMNS else [pytest.mark.slow])
        for c in COLUMNS
    ],
)
def test_column(name):
    cells = compute_column(COLUMNS_BY_NAME[name])
    _check_column(name, cells)
    committed = load()
    if committed["jax"] != jax.__version__:
        pytest.skip(f"table.json was generated with JAX {committed['jax']}")
    got = {function: cell.as_json() for function, cell in cells.items()}
    expected = committed["columns"][name]
    changed = [
        f"{function}: committed {expected.get(function)}, now {got.get(function)}"
        for function in sorted(set(got) | set(expected))
        if got.get(function) != expected.get(function)
    ]
    assert not changed, f"column {name} changed ({_REGENERATE}):\n" + "\n".join(changed)


def test_page_is_the_committed_table():
    assert PAGE.read_text(encoding="utf-8") == render_page(load()), (
        f"docs/supported-functions.md is not the rendering of table.json: {_REGENERATE}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in COLUMNS])
def test_column_compiled(name):
    # The same table with every call compiled by `jax.jit` rather than evaluated
    # equation by equation: the same outcomes.
    cells = compute_column(COLUMNS_BY_NAME[name], jit=True)
    _check_column(name, cells)
    committed = load()["columns"][name]
    changed = {f: c.as_json() for f, c in cells.items() if c.as_json() != committed.get(f)}
    assert not changed, changed


# --- core bugs the table found ---------------------------------------------------------


def test_a_plain_carry_meeting_a_quantity_is_refused_naming_the_operation():
    # `jnp.polyval`'s pattern: the carry starts as a plain array and meets a
    # quantity inside the loop. A start that is a traced argument could be
    # anything, not only 0: refused where it happens, naming `add` and the way
    # out.
    def f(x, start):
        return jax.lax.scan(lambda c, x: (c + x, None), start, x)[0]

    with pytest.raises(UnitError, match="`add` got a plain array"):
        jax.jit(quaxlike.quaxify(f))(Unitful(jnp.ones(3), m), jnp.zeros(()))


def test_a_plain_carry_of_known_zeros_takes_the_unit_it_meets():
    # The same loop from `jnp.zeros`, made under `jax.jit`: a constant known
    # while tracing, and 0 fits every unit, so the carry becomes a quantity.
    def f(x):
        return jax.lax.scan(lambda c, x: (c + x, None), jnp.zeros(()), x)[0]

    out = jax.jit(quaxlike.quaxify(f))(Unitful(jnp.array([1.0, 2.0, 3.0]), m))
    assert out.unit == m and float(out.array) == 6.0
