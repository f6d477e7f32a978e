import pytest


_COVERAGE_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def report_coverage(request):
    """Lines to show in the terminal summary (with or without `-s`)."""

    def report(line: str) -> None:
        request.config.stash.setdefault(_COVERAGE_LINES, []).append(line)

    return report


@pytest.fixture
def examples(request):
    """`examples(n)`: a hypothesis `max_examples` of n, or 8n with `--run-slow`."""
    factor = 8 if request.config.getoption("--run-slow") else 1
    return lambda n: n * factor


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_COVERAGE_LINES, [])
    if lines:
        terminalreporter.write_sep("-", "quaxlike conformance coverage")
        for line in lines:
            terminalreporter.write_line(line)
