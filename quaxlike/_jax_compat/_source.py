"""Pointing at user code: quaxlike's frames are hidden like JAX's, and the
user's line is the innermost frame outside the libraries."""

import os
import sys

from ._probing import _first, _module, _source_info_util, _traceback_util


# --- pointing at user code ---------------------------------------------------

# The quaxlike package (this subpackage's parent).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Treat quaxlike's own frames like JAX's: left out of JAX's filtered tracebacks,
# and skipped when looking for "the user's line".
for _util in (_source_info_util, _traceback_util):
    if hasattr(_util, "register_exclusion"):
        _util.register_exclusion(_PACKAGE_DIR)  # pyright: ignore
api_boundary = _first((_traceback_util, "api_boundary")) or (lambda fn: fn)
_is_user_filename = _first((_source_info_util, "is_user_filename")) or (
    lambda name: not name.startswith(_PACKAGE_DIR)
)


class SourceLine:
    def __init__(self, filename, lineno, function):
        self.filename, self.lineno, self.function = filename, lineno, function

    @property
    def text(self) -> str:
        if self.filename is None:
            return "an unknown line"
        return f"{self.filename}:{self.lineno} (in {self.function})"


# Libraries between the user's code and a primitive: never "the user's line".
def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in ("jax", "jaxlib", "equinox", "plum", "jaxtyping", "beartype"):
        module = _module(name)
        filename = getattr(module, "__file__", None)
        if filename:
            dirs.append(os.path.dirname(os.path.abspath(filename)) + os.sep)
    return tuple(dirs)


_NOT_USER = _library_dirs()


def user_source_line() -> SourceLine:
    """The innermost frame of the current Python stack outside JAX, quaxlike,
    Equinox, plum and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_user_filename(filename) and not filename.startswith(_NOT_USER):
            return SourceLine(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return SourceLine(None, None, None)


# --- errors raised while tracing ---------------------------------------------

# What JAX chains to an error raised while it evaluates an equation of a traced
# program: the user's lines that emitted the equation, rebuilt from its source
# information (so it holds none of the trace's tracers).
_UserStackTrace = _first((_source_info_util, "JaxStackTraceBeforeTransformation"))


def without_traced_frames(error: BaseException) -> BaseException:
    """`error`, with its traceback and those of the errors chained to it dropped:
    they hold the frames, and so the tracers, of the trace it was raised in. JAX's
    account of the user's line (`JaxStackTraceBeforeTransformation`) is kept where
    this release has one.

    **Arguments:**

    - `error`: an error caught inside a trace that then ends normally.

    **Returns:**

    `error`, changed in place.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _UserStackTrace is None or not isinstance(current, _UserStackTrace):
            current.__traceback__ = None
        current.__context__ = None
        current = current.__cause__
    return error
