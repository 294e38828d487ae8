"""The commands' error boundary: every failure of ``hybridflow COMMAND`` as one line on stderr, exit code 2.

User mistakes (``ValueError``) and the run's own errors (a checkpoint that cannot be written, a busy run
directory, a worker's or a reward function's error, a timeout) are printed as they are; anything else is
summarized as ``Type: first line`` with the full traceback written to a file under the run's ``errors/``
directory (or a temporary directory before there is one), named in the line. SIGINT and SIGTERM end a run
with one line (exit code 128 + the signal number); a hard ``os._exit`` in the driver says who called it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Iterator

# errno -> (the cause in plain words, what to do); the text forms are those a worker's traceback carries
CAUSES = {errno.ENOSPC: ("no space left on the device", "free disk space under {dir}"),
          errno.EDQUOT: ("the disk quota is exceeded", "free disk space under {dir}"),
          errno.EACCES: ("permission denied", "make {dir} writable"),
          errno.EPERM: ("permission denied", "make {dir} writable"),
          errno.EROFS: ("the file system is read-only", "make {dir} writable"),
          errno.EIO: ("an I/O error of the disk", "check the disk holding {dir}"),
          errno.ENOTDIR: ("a path on the way is a file, not a directory", "make {dir} a writable directory")}
CAUSE_TEXTS = {os.strerror(number): number for number in CAUSES}


def failure_cause(error: BaseException) -> tuple[str, str] | None:
    """(the cause in plain words, advice with ``{dir}``) of a save failure: an OSError's errno anywhere in the
    exception's chain, or its text in a worker's traceback; None when neither names a known cause."""
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in CAUSES:
            return CAUSES[current.errno]
        current = current.__cause__ or current.__context__
    text = str(error)
    for message, number in CAUSE_TEXTS.items():
        if message in text:
            return CAUSES[number]
    return None


# the errors whose message is written for a user: printed as they are
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError,)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver (a KeyboardInterrupt, so no ``except Exception`` handler swallows it)."""

    def __init__(self, signal_number: int, *, saved: Path | None = None) -> None:
        self.signal_number = signal_number
        self.saved = saved
        super().__init__(signal.Signals(signal_number).name)


def errors_directory(output_dir: object) -> Path:
    """``OUTPUT_DIR/errors`` when ``output_dir`` can hold it, else a temporary directory."""
    if isinstance(output_dir, (str, os.PathLike)) and str(output_dir).strip():
        path = Path(output_dir)
        if (path.is_dir() or not path.exists()) and all(not p.exists() or p.is_dir() for p in path.parents):
            return path / "errors"
    return Path(tempfile.gettempdir()) / "hybridflow-errors"


def write_traceback(directory: Path, prog: str, error: BaseException) -> Path:
    """The full traceback of ``error`` in a new file under ``directory`` (the temporary directory if that fails)."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    name = f"error-{prog.replace(' ', '-')}-{os.getpid()}-{id(error):x}.txt"
    for folder in (directory, Path(tempfile.gettempdir()) / "hybridflow-errors"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
            return folder / name
        except OSError:
            continue
    return Path("(unwritable)")


def one_line(error: BaseException, errors_dir: Path, prog: str, note: str = "") -> str:
    """The message of ``error`` for a user: its own text for known errors, else type + first line + traceback file."""
    if isinstance(error, USER_ERRORS):  # before any import: a config error answers without torch
        return str(error)
    # an error of a module that was never imported cannot have been raised: look the classes up, import nothing
    worker_errors = _loaded_classes(("hybridflow.controller.errors", "WorkerError"),
                                    ("hybridflow.controller.errors", "WorkerTimeoutError"),
                                    ("hybridflow.rewards.plugin", "RewardError"))
    if worker_errors and isinstance(error, worker_errors):
        from hybridflow.controller.errors import user_message

        return user_message(error, errors_dir)
    run_errors = _loaded_classes(("hybridflow.trainers.checkpoint", "CheckpointSaveError"),
                                 ("hybridflow.trainers.run_dir", "RunDirectoryBusyError"))
    if run_errors and isinstance(error, run_errors):
        return str(error)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    path = write_traceback(errors_dir, prog, error)
    summary = f"{type(error).__name__}{': ' + lines[0] if lines else ''}"
    cause = failure_cause(error) if isinstance(error, OSError) else None
    if cause is not None:  # a full disk, a read-only or unwritable directory: said in words, with what to do
        where = getattr(error, "filename", None) or (errors_dir.parent if errors_dir.name == "errors" else Path.cwd())
        advice = cause[1].format(dir=repr(str(where)))
        return f"{cause[0]} ({summary}){'; ' + note if note else ''}; {advice} (full traceback: {path})"
    return f"{summary} (full traceback: {path})"


def _loaded_classes(*names: tuple[str, str]) -> tuple[type, ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in names if module in sys.modules)


def run_guarded(prog: str, body: Callable[[], int], *, errors_dir: Callable[[], Path],
                interrupted: Callable[[RunInterrupted | None], str] = lambda error: "") -> int:
    """``body()``'s exit code, or 2 after printing any failure as one line (128 + N after signal N); ``interrupted``
    says where the run stands (after a signal, and after a disk error: None)."""
    try:
        try:
            return body()
        except SystemExit as error:
            if error.code != signal.SIGTERM:
                raise
            # ray.init replaces the SIGTERM handler with one calling sys.exit(SIGTERM): the same stop, said the same way
            raise RunInterrupted(signal.SIGTERM) from None
    except RunInterrupted as error:
        note = interrupted(error)
        print(f"{prog}: stopped by {signal.Signals(error.signal_number).name}{'; ' + note if note else ''}",
              file=sys.stderr, flush=True)
        return 128 + error.signal_number
    except KeyboardInterrupt:  # before the handlers are installed (imports) or after they are restored
        print(f"{prog}: stopped by SIGINT", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except Exception as error:
        note = interrupted(None) if isinstance(error, OSError) else ""  # where the run stands, as after a signal
        print(f"{prog}: error: {one_line(error, errors_dir(), prog, note)}", file=sys.stderr, flush=True)
        return 2


@contextlib.contextmanager
def signals_stop_the_run(*, graceful: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """Within this block SIGINT and SIGTERM raise ``RunInterrupted`` in the main thread. With ``graceful()`` true
    the first signal is only recorded in the yielded dict (``{"signal": N}``) for the loop to stop at a step's end
    (a second one raises at once); ``request["reinstall"]()`` installs the handlers again."""
    request: dict = {"reinstall": lambda: None}

    def handle(signum, frame):
        if graceful() and "signal" not in request:
            request["signal"] = signum
            print(f"{signal.Signals(signum).name}: finishing this step and saving a checkpoint; send it again to "
                  f"stop at once", file=sys.stderr, flush=True)
            return
        raise RunInterrupted(signum)

    if sys.platform == "win32" or signal.getsignal(signal.SIGINT) is None:
        yield request
        return
    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    # for code that replaced them meanwhile (ray.init installs its own SIGTERM handler)
    request["reinstall"] = lambda: [signal.signal(number, handle) for number in previous]
    try:
        yield request
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def hard_exits_reported(prog: str, note: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Within this block an ``os._exit`` called in this process (a reward function or module ending the run) prints
    one line naming its caller before the process ends; forked children exit silently as before."""
    real_exit, pid = os._exit, os.getpid()

    def reported_exit(code: int) -> None:
        if os.getpid() == pid:
            caller = sys._getframe(1)
            where = f"{caller.f_code.co_filename}:{caller.f_lineno} (in {caller.f_code.co_name})"
            extra = note()
            print(f"{prog}: error: os._exit({code}) was called from {where}; the run ended without cleaning up"
                  f"{'; ' + extra if extra else ''}", file=sys.stderr, flush=True)
        real_exit(code)

    os._exit = reported_exit
    try:
        yield
    finally:
        os._exit = real_exit
