"""Every public docstring is complete, and its examples run.

The examples run in one fresh interpreter (`_docstrings.py`), each in its own
namespace, with warnings as errors and checked mode on; a rule an example
registers cannot leak into the rest of the suite.
"""

import inspect
import json
import os
import subprocess
import sys

import pytest
from _docstrings import documented, examples
from test_docs import _env, ROOT


DOCUMENTED = documented()
EXAMPLES = examples()


@pytest.fixture(scope="module")
def report() -> dict:
    result = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "_docstrings.py")],
        cwd=ROOT,
        env=_env({}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-8000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(report, name):
    error = report[name]
    if error is not None:
        pytest.fail(f"the example in the docstring of `{name}` failed:\n{error}", pytrace=False)


def _exported_objects():
    import importlib

    from _docstrings import _public_names, PACKAGES

    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in _public_names(module):
            obj = getattr(module, name)
            if getattr(obj, "__module__", "").startswith("quaxlike") and (
                inspect.isclass(obj) or inspect.isfunction(obj)
            ):
                yield f"{package}.{name}", obj


EXPORTED = dict(_exported_objects())


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_public_docstring_is_complete(name):
    obj = EXPORTED[name]
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"`{name}` has no docstring"
    summary = doc.strip().split("\n\n", 1)[0]
    assert summary.rstrip().endswith((".", ":")), f"`{name}`: the summary should be a sentence"
    if inspect.isfunction(obj):
        assert "**Arguments:**" in doc, f"`{name}`: no **Arguments:** section"
    elif not issubclass(obj, Exception):
        # Classes users build list their arguments; those quaxlike builds for them
        # (`Report`) list their attributes.
        assert "**Arguments:**" in doc or "**Attributes:**" in doc, (
            f"`{name}`: no **Arguments:** (or **Attributes:**) section"
        )
    if inspect.isfunction(obj) and inspect.signature(obj).return_annotation is not None:
        assert "**Returns:**" in doc, f"`{name}`: no **Returns:** section"
    assert name in EXAMPLES, f"`{name}`: no ```python example"
