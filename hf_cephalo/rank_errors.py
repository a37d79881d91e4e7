"""Under a launcher, show an error raised on several ranks once and name it in the launcher's report.

``install_rank_error_hook`` (installed when ``hf_cephalo`` is imported) and
``report_error_once(message)`` (for a program that prints its own ``error: ...``) make the first
rank on a machine to fail with an error print it once, a lost-connection consequence one line
per machine, and every failing rank write torchrun's error file, so the launcher names the first
error as "Root Cause". ``HF_CEPHALO_ALL_RANK_ERRORS=1`` keeps Python's default. What a user
sees, and what is not covered: docs/accelerate.md, "Errors under a launcher".

[Note: one error report per job]
Which rank prints is an election without communication (the process group may be what broke):
a rank prints iff it atomically creates (``os.link``) a file named by the error's fingerprint
(SHA-1 of ``error_identity``: type name and message, with what differs between processes of one
job removed by ``normalized_message``) in a temp directory keyed by the job. So an identical
error prints once per machine, a different message prints too, and lost-connection errors share
one fingerprint. The hook ignores SIGTERM while it runs (the launcher's stop of the other ranks)
so the winner is not killed mid-print, and a quiet rank's error file is timestamped after its
cause's, so the launcher's "Root Cause" is the printed error. The job key, stale directories,
signals and timestamps: docs/accelerate.md, "One error report per job".
"""

from __future__ import annotations

import enum
import os
import re
import sys
from typing import Any, Callable, NamedTuple

from hf_cephalo.environment import env_flag

__all__ = ["ALL_RANK_ERRORS_ENV", "ErrorKind", "classify_error", "error_file_record",
           "error_identity", "install_rank_error_hook", "normalized_message", "report_error_once"]

ALL_RANK_ERRORS_ENV = "HF_CEPHALO_ALL_RANK_ERRORS"
"""Environment variable: ``1`` / ``true`` / ``yes`` keeps Python's default (every rank prints)."""

STALE_JOB_DIR_S = 24 * 3600.0
"""Age in seconds after which another job's election directory is removed."""

_MAX_LINE_CHARS = 200
_MAX_CAUSE_DEPTH = 8

# Substrings (lower case) of the errors torch.distributed raises on a rank whose peer process
# exited: gloo ("[.../gloo/transport/tcp/pair.cc] Connection closed by peer [...]. This is
# typically caused by a remote worker crashing"), the TCPStore (its server is rank 0's process),
# NCCL after an abort. They are only matched on RuntimeError (torch's C++ errors and its
# DistError family); an OSError with the same words is this process's own socket or pipe (a
# download, a closed stdout) and is a cause.
_CONNECTION_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "caused by a remote worker crashing",
    "communicator was aborted",
    "remote process exited",
)
_CONNECTION_LOST_TYPES = frozenset({"DistNetworkError"})

_JOB_DIR_PREFIX = "hf_cephalo-errors-"
_CONSEQUENCE_FINGERPRINT = "lost-connection"

_previous_hook: Callable[..., Any] | None = None


class ErrorKind(enum.Enum):
    """What an uncaught exception on a rank says about the job."""

    CAUSE = "cause"
    """Raised by this rank's own code, settings or data: printed once per distinct message."""

    CONSEQUENCE = "consequence"
    """This rank lost its connection to a rank that stopped first: one line per machine."""


class _Election(NamedTuple):
    """Outcome of one fingerprint's election on this machine."""

    won: bool
    """True when this rank was the first with the fingerprint (it prints)."""

    first_rank: int | None
    """The rank that was first (this rank when ``won``); None when its file was unreadable."""


def _launched_with_several_ranks() -> bool:
    """torchrun (and ``accelerate launch``) set WORLD_SIZE, RANK and LOCAL_RANK on each worker."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world_size > 1 and ("RANK" in os.environ or "LOCAL_RANK" in os.environ)


def _rank() -> int:
    """This process's global rank (RANK, else LOCAL_RANK), -1 when neither parses."""
    for name in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return -1


def _headline(exc: BaseException) -> str:
    """``"<Type>: <message>"``, as torch's error handler writes it."""
    return f"{type(exc).__name__}: {exc}"


def _first_line(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"``, cut at ``_MAX_LINE_CHARS`` characters."""
    message = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    return line if len(line) <= _MAX_LINE_CHARS else line[:_MAX_LINE_CHARS - 3] + "..."


# An innermost bracketed group: (...), [...] or {...} with no bracket inside.
_GROUP_RE = re.compile(r"\(([^()\[\]{}]*)\)|\[([^()\[\]{}]*)\]|\{([^()\[\]{}]*)\}")
# A processed group is re-written with these stand-ins for its brackets (private-use code
# points), so the next pass sees it as plain text inside the group around it.
_STAND_INS = {"(": "\ue000", ")": "\ue001", "[": "\ue002", "]": "\ue003", "{": "\ue004",
              "}": "\ue005"}
_OPENING_STAND_INS = frozenset(_STAND_INS[b] for b in "([{")
_CLOSING_STAND_INS = frozenset(_STAND_INS[b] for b in ")]}")
_NUMBER_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# per-process values: object addresses ("at 0x7f3a1c2b4d60") and tempfile's random names
_VOLATILE = ((re.compile(r"0x[0-9a-fA-F]{6,}"), "0x?"),
             (re.compile(r"\btmp[a-z0-9_]{8}\b"), "tmp?"))


def _items(text: str) -> list[str]:
    """``text`` split at its commas, except those inside an already sorted (stand-in) group."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in _OPENING_STAND_INS) - (char in _CLOSING_STAND_INS)
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return [*items, text[start:].strip()]


def _sorted_group(match: re.Match) -> str:
    opening = "([{"[next(i for i, g in enumerate(match.groups()) if g is not None)]
    closing = {"(": ")", "[": "]", "{": "}"}[opening]
    items = _items(match.group(match.lastindex))
    if len(items) > 1 and not all(_NUMBER_RE.fullmatch(item) for item in items):
        items = sorted(items)  # a tuple of numbers (a shape) keeps its order: it is meaning
    return _STAND_INS[opening] + ", ".join(items) + _STAND_INS[closing]


def normalized_message(message: str) -> str:
    """``message`` with what differs between the processes of one job for the same error
    removed ([Note: one error report per job]): the comma-separated items of every ``(...)``,
    ``[...]`` and ``{...}`` sorted, innermost first (a ``set`` of strings, and lists built from
    one, iterate in a per-process order: ``PYTHONHASHSEED`` differs per process), unless all of
    them are numbers; hexadecimal addresses (``0x7f3a...``) become ``0x?`` and tempfile's
    random names (``tmpk2j4_x9a``) ``tmp?``. Only compared, never shown."""
    for pattern, blank in _VOLATILE:
        message = pattern.sub(blank, message)
    while True:
        message, count = _GROUP_RE.subn(_sorted_group, message)
        if not count:
            break
    for bracket, stand_in in _STAND_INS.items():
        message = message.replace(stand_in, bracket)
    return message


def error_identity(type_name: str, message: str) -> str:
    """What makes two ranks' errors one error ([Note: one error report per job]): the type's
    name and ``normalized_message(message)``."""
    return f"{type_name}: {normalized_message(message)}"


def classify_error(exc: BaseException) -> ErrorKind:
    """``ErrorKind.CONSEQUENCE`` when ``exc``, or an exception it was raised from
    (``raise ... from``, followed up to 8 deep), is torch.distributed reporting a lost peer:
    a ``DistNetworkError``, or a RuntimeError whose message says the connection was closed /
    reset by the peer, the pipe broke, or the communicator was aborted. Otherwise
    ``ErrorKind.CAUSE``. Never raises; imports nothing (torch's types are matched by name)."""
    link: BaseException | None = exc
    for _ in range(_MAX_CAUSE_DEPTH):
        if link is None:
            break
        if isinstance(link, RuntimeError) and not isinstance(link, OSError):
            names = {cls.__name__ for cls in type(link).__mro__}
            text = str(link).lower()
            if names & _CONNECTION_LOST_TYPES or any(m in text for m in _CONNECTION_LOST_MARKERS):
                return ErrorKind.CONSEQUENCE
        link = link.__cause__
    return ErrorKind.CAUSE


def error_file_record(exc: BaseException, timestamp_s: float, shown: str) -> dict:
    """The JSON object torchrun's agent reads from a worker's ``TORCHELASTIC_ERROR_FILE``.

    The format of ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``:
    ``{"message": {"message": "<Type>: <message>", "extraInfo": {"py_callstack": shown,
    "timestamp": "<whole seconds since the epoch>"}}}``. The launcher's report shows ``shown``
    (where torch's ``@record`` puts the whole traceback) and names the failure with the smallest
    ``timestamp_s`` (seconds since the epoch, truncated) as "Root Cause".
    """
    return _record(_headline(exc), timestamp_s, shown)


def _record(headline: str, timestamp_s: float, shown: str) -> dict:
    return {"message": {"message": headline,
                        "extraInfo": {"py_callstack": shown,
                                      "timestamp": str(int(timestamp_s))}}}


def _write_error_file(record: dict) -> None:
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if path:  # empty when the launcher keeps no logs
        with open(path, "w") as f:
            json.dump(record, f)


def _job_key() -> str:
    """What the workers of one launch on one machine share, and another launch does not."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    attempt_dir = os.path.dirname(os.path.dirname(error_file)) if error_file else ""
    parts = [str(os.getppid()), os.environ.get("MASTER_PORT", ""),
             os.environ.get("TORCHELASTIC_RUN_ID", ""),
             os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), attempt_dir]
    return "|".join(parts)


def _remove_stale_job_dirs(base: str, keep: str, now_s: float) -> None:
    import shutil

    for entry in os.scandir(base):
        try:
            if (entry.name != keep and entry.is_dir(follow_symlinks=False)
                    and now_s - entry.stat(follow_symlinks=False).st_mtime > STALE_JOB_DIR_S):
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue  # another job removed it first


def _job_dir() -> str:
    """This job's election directory, created (mode 0700) on first use. Raises OSError when the
    temp directory is unusable or the per-user directory is not this user's own directory."""
    import hashlib
    import stat
    import tempfile
    import time

    uid = os.getuid() if hasattr(os, "getuid") else 0
    base = os.path.join(tempfile.gettempdir(), f"{_JOB_DIR_PREFIX}{uid}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != uid):
        raise PermissionError(f"{base} is not a directory owned by this user")
    name = hashlib.sha1(_job_key().encode()).hexdigest()[:20]
    path = os.path.join(base, name)
    try:
        os.mkdir(path, mode=0o700)
    except FileExistsError:
        return path
    _remove_stale_job_dirs(base, keep=name, now_s=time.time())  # once per job: its first rank
    return path


def _elect(fingerprint: str, rank: int) -> _Election:
    """Whether this rank is the first on this machine to report ``fingerprint`` in this job.
    Raises OSError when the election directory cannot be used (the caller then prints)."""
    path = os.path.join(_job_dir(), fingerprint)
    candidate = f"{path}.{os.getpid()}"
    with open(candidate, "w") as f:
        f.write(str(rank))
    try:
        os.link(candidate, path)  # atomic: exactly one rank creates the name, with its content
        return _Election(won=True, first_rank=rank)
    except FileExistsError:
        try:
            with open(path) as f:
                return _Election(won=False, first_rank=int(f.read()))
        except (OSError, ValueError):
            return _Election(won=False, first_rank=None)
    finally:
        os.unlink(candidate)


class _Report(NamedTuple):
    """What the hook prints for one exception."""

    line: str | None
    """One line written to stderr first, or None."""

    traceback: bool
    """Whether the previous hook then prints the traceback."""


_FULL_REPORT = _Report(line=None, traceback=True)


def _report(exc: BaseException) -> _Report:
    """Decide what this rank prints and write its error file (the election's side effects)."""
    import time

    rank = _rank()
    if classify_error(exc) is ErrorKind.CONSEQUENCE:
        line = (f"rank {rank} stopped: lost the connection to another rank, which failed first "
                f"({_first_line(exc)})")
        # after its cause, whose rank exited (closing the connection) after writing its own
        _write_error_file(error_file_record(exc, time.time() + 1, shown=line))
        won = _elect(_CONSEQUENCE_FINGERPRINT, rank).won
        return _Report(line=line if won else None, traceback=False)
    kind = type(exc).__name__  # as report_error_once's kind: one election for both routes
    won = _elect_and_record(_headline(exc), kind, rank, shown="traceback",
                            identity=error_identity(kind, str(exc)))
    if not won:
        return _Report(line=None, traceback=False)
    return _Report(line=(f"rank {rank} failed first with the error below; other ranks with "
                         f"the same error stay quiet ({ALL_RANK_ERRORS_ENV}=1 shows them)"),
                   traceback=True)


def _elect_and_record(headline: str, kind: str, rank: int, shown: str, identity: str) -> bool:
    """The election of a cause (``identity``: ``error_identity``) and this rank's error file,
    which records ``headline`` (``"<Type>: <message>"``, as this rank raised it); True when
    this rank was first (it prints). ``shown`` names what the first rank prints ("traceback",
    "message"), for the quiet ranks' report entries. Raises OSError as ``_elect``."""
    import hashlib
    import time

    now_s = time.time()
    election = _elect(hashlib.sha1(identity.encode("utf-8", "replace")).hexdigest(), rank)
    if election.won:
        _write_error_file(_record(headline, now_s, shown=headline))
        return True
    # the first rank took its timestamp before its election: one second later orders this after
    first = "another rank" if election.first_rank is None else f"rank {election.first_rank}"
    line = f"{kind}: same error as {first} (its {shown} is printed above)"
    _write_error_file(_record(headline, time.time() + 1, shown=line))
    return False


def report_error_once(message: str, kind: str = "ValueError") -> bool:
    """For a program that reports an error itself (prints it and exits with a status) instead
    of raising it: whether this rank should print ``message``.

    Under a launcher with several ranks (where ``install_rank_error_hook`` installs the hook)
    this runs the hook's election on ``"<kind>: <message>"`` and writes this rank's error file,
    so the same message prints once per machine and the launcher's report names it as "Root
    Cause" ([Note: one error report per job]); True on the rank that was first, False on the
    others. Without a launcher, with ``HF_CEPHALO_ALL_RANK_ERRORS`` set, or when the election
    directory or error file cannot be used: True (print as without this function). Never
    raises. Unlike the hook, it cannot hold off the launcher's SIGTERM while the caller prints
    (a window of microseconds between the election and the print).
    """
    if not _launched_with_several_ranks() or env_flag(ALL_RANK_ERRORS_ENV):
        return True
    try:
        return _elect_and_record(f"{kind}: {message}", kind, _rank(), shown="message",
                                 identity=error_identity(kind, message))
    except Exception:  # never hide the error: print it
        return True


def _ignore_sigterm() -> Callable[[], None]:
    """Ignore SIGTERM until the returned function is called ([Note: one error report per job]:
    the launcher's SIGTERM must not end a printing rank). Does nothing off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (ValueError, OSError, AttributeError):
        return lambda: None
    # None: a handler installed outside Python; the closest to it Python can restore is SIG_DFL
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except Exception:  # a closed or broken stderr: nothing more can be shown
        pass


class _RankErrorHook:
    """``sys.excepthook`` reporting an uncaught exception once per job ([Note: one error report
    per job]); ``previous`` prints tracebacks and takes every case this hook does not handle."""

    def __init__(self, previous: Callable[..., Any], ignore_sigterm: bool = True):
        self.previous = previous
        self.ignore_sigterm = ignore_sigterm

    def __call__(self, exc_type, exc, tb) -> None:
        # KeyboardInterrupt (a person stopping the job) and the rare non-Exception errors keep
        # the default report, as does an exception an outer instance of this hook has handled
        if not isinstance(exc, Exception) or getattr(exc, "_hf_cephalo_reported", False):
            self.previous(exc_type, exc, tb)
            return
        restore_sigterm = _ignore_sigterm() if self.ignore_sigterm else (lambda: None)
        try:
            try:
                exc._hf_cephalo_reported = True
                report = _report(exc)
                if report.line is not None:
                    sys.stderr.write(report.line + "\n")
                    sys.stderr.flush()
            except Exception:  # the hook must never hide the error: the full traceback instead
                report = _FULL_REPORT
            if report.traceback:
                self.previous(exc_type, exc, tb)
                _flush_stderr()  # written before SIGTERM may end the process again
        finally:
            restore_sigterm()


def install_rank_error_hook() -> bool:
    """Install the once-per-job error report as ``sys.excepthook`` (chained to the current hook).

    Only for a worker of a launch with several ranks (``WORLD_SIZE`` > 1 and ``RANK`` or
    ``LOCAL_RANK`` set, as torchrun and ``accelerate launch`` set them) and unless
    ``HF_CEPHALO_ALL_RANK_ERRORS`` is ``1``/``true``/``yes``. Idempotent (installs at most once
    per process). Returns True when the hook is installed (now or before).
    """
    global _previous_hook
    if _previous_hook is not None:
        return True
    if not _launched_with_several_ranks() or env_flag(ALL_RANK_ERRORS_ENV):
        return False
    _previous_hook = sys.excepthook
    sys.excepthook = _RankErrorHook(_previous_hook)
    return True
