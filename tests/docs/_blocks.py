"""Finding the Python code blocks of a Markdown page (or a docstring).

A block is a fenced code block whose info string starts with `python` (or
`py`), at any indentation (inside an admonition or a content tab). It is run
unless the nearest non-blank line above its opening fence is the comment
`<!-- no-run -->`. Blocks in other languages (`text`, `bash`, ...) are never run.

A page may ask for a special environment with a comment anywhere in it:
`<!-- docs-test: devices=8 -->` runs it with eight virtual CPU devices.
"""

import re
import textwrap
from typing import NamedTuple


NO_RUN = "<!-- no-run -->"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_OPTIONS = re.compile(r"<!--\s*docs-test:(?P<options>[^>]*)-->")


class Block(NamedTuple):
    line: int  # 1-based line number of the first line of code
    code: str  # dedented
    run: bool


def _is_python(info: str) -> bool:
    info = info.strip()
    if info.startswith("{"):  # attribute-list form: {.python .extra}
        return ".python" in info.split() or ".py" in info.split()
    language = info.split(" ", 1)[0].split("{", 1)[0].strip().lower()
    return language in ("python", "py", "python3")


def blocks(text: str) -> list[Block]:
    """Every Python fenced block in `text`, in order."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"]
        start = i
        j = i + 1
        while j < len(lines):
            closing = lines[j].strip()
            if (
                closing.startswith(fence[0] * len(fence))
                and set(closing) == {fence[0]}
                and _indent_width(lines[j]) <= _indent_width(indent) + 3
            ):
                break
            j += 1
        if _is_python(info):
            previous = next(
                (lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), ""
            )
            body = "\n".join(
                line[len(indent) :] if line.startswith(indent) else line.lstrip()
                for line in lines[start + 1 : j]
            )
            found.append(Block(start + 2, textwrap.dedent(body), previous != NO_RUN))
        i = j + 1
    return found


def _indent_width(s: str) -> int:
    return len(s) - len(s.lstrip(" \t"))


def options(text: str) -> dict[str, str]:
    """The `<!-- docs-test: key=value ... -->` options of a page."""
    found: dict[str, str] = {}
    for match in _OPTIONS.finditer(text):
        for item in match["options"].split():
            key, _, value = item.partition("=")
            found[key.strip()] = value.strip()
    return found
