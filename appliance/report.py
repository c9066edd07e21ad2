"""Messages to the user: one reporter, Python's ``logging`` under the ``appliance`` logger.

Code below the entry points says what it is doing and never chooses where that goes::

    log = report.get(__name__)
    log.info("cluster %s ready", name)        # or an f-string: messages are one line each

The entry point chooses, once, with ``report.to(sink)`` (a callable taking one line):

- the CLI: ``click.echo``; under ``--json`` stderr, so stdout holds only the JSON (or nowhere, for verbs whose JSON
  says it all);
- ``train``, while the job runs: the job's output, so the lines are in its log copy;
- node-side code: the stager's entry, the launcher<->node protocol's note lines; the Checkpointer and the file
  syncer, which live as long as the user's process, the job's output, with ``report.default(sink)``, which leaves
  a sink already chosen (a test's) in place;
- a test: the ``said`` fixture (``report.to(said.append)``) instead of a ``log=`` argument.

With no sink chosen, INFO messages go nowhere (library use stays quiet) and warnings reach stderr (``logging``'s
last resort). A ``logging`` handler is process-wide, so messages from the thread pools the steps start (one
thread per node) reach the same sink. ``prefixed`` and ``muted`` act on the calling thread only (a
``ContextVar``): a step that is not worth showing inside another (the testbed's teardown inside `cloud stop`)
runs muted; a sub-step's lines can carry the step's tag (``[resume]``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar

ROOT = "appliance"
Sink = Callable[[str], None]

_scope: ContextVar[str | None] = ContextVar("appliance_report_scope", default="")  # a prefix; None: muted


def get(name: str) -> logging.Logger:
    """The logger of a module of the appliance (``report.get(__name__)``)."""
    return logging.getLogger(name)


class _Sink(logging.Handler):
    def __init__(self, sink: Sink):
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        prefix = _scope.get()
        if prefix is None:
            return
        try:
            self.sink(prefix + record.getMessage())
        except Exception:  # noqa: BLE001 - a sink that fails (a closed pipe) must not fail the step that reports
            self.handleError(record)


def _ours(root: logging.Logger) -> list[logging.Handler]:
    return [h for h in root.handlers if isinstance(h, _Sink)]


@contextlib.contextmanager
def to(sink: Sink | None) -> Iterator[None]:
    """Every message of the appliance's code goes to ``sink`` (None: nowhere) while inside; the sink chosen before
    is back after."""
    root = logging.getLogger(ROOT)
    before, level, propagate = _ours(root), root.level, root.propagate
    for h in before:
        root.removeHandler(h)
    h = _Sink(sink if sink is not None else (lambda m: None))
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(h)
        for b in before:
            root.addHandler(b)
        root.setLevel(level)
        root.propagate = propagate


def default(sink: Sink) -> None:
    """Node-side code's sink for the rest of the process, unless one is chosen already."""
    root = logging.getLogger(ROOT)
    if not _ours(root):
        root.addHandler(_Sink(sink))
        root.setLevel(logging.INFO)
        root.propagate = False


@contextlib.contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Lines said by this thread while inside start with ``prefix``."""
    now = _scope.get()
    token = _scope.set(None if now is None else now + prefix)
    try:
        yield
    finally:
        _scope.reset(token)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Nothing this thread says while inside reaches the sink."""
    token = _scope.set(None)
    try:
        yield
    finally:
        _scope.reset(token)
