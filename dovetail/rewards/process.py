"""Your own reward ("package.module:function") runs in a process of its own, so that `reward_timeout_s` holds
whatever the reward does. A thread could not do it: Python cannot stop one, and a thread that holds the GIL (a
regular expression backtracking, a big integer's power, a C extension's loop) keeps the caller from even seeing
that its time is up. A process is killed.

There is one reward process per process that calls rewards (the reference loop's, each Ray DeviceWorker's),
started on the first call and kept, so a step pays a round trip through a pipe, not an interpreter's start-up. It
is a fresh interpreter (safe beside CUDA and threads), not multiprocessing's "spawn", which would run the
caller's main script again in it (a script that calls `dovetail.train` at its top level would train again). Each
call carries the caller's working directory, `sys.path` and environment as they are then, so a reward sees what
it would see in the caller; the process imports each reward by its name on first use. The time limit counts from
the call's request to its answer: the reward's first import is in it, the interpreter's start-up is not. A call
that overruns kills the process, and the next call starts another.

What a reward raises comes back as its type and message, SystemExit and KeyboardInterrupt included: no exception
it raises and no exit it makes ends or interrupts the calling process (the reward process ignores Ctrl-C, which is
the run's to handle: it stops after the step in flight). A reward that ends its process (os._exit, a crash in C)
has failed too, and so has one whose output cannot be sent back (pickled)."""

import importlib
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, Pipe


class Raised(Exception):
    """The reward raised; the message is "Type: message"."""


class Failed(Exception):
    """The call failed otherwise; the message says how, following the reward's name."""


class Server:
    """A fresh interpreter running `program` (its argument: the descriptor of its end of a pipe), which answers each
    request on the pipe; started on first use and kept, killed wherever its state is unknown. The reward process is
    one; an environment's episodes run in another (`dovetail.envs.host`)."""

    def __init__(self, program: str):
        self.program = program
        self.lock = threading.Lock()
        self._running: tuple[subprocess.Popen, Connection] | None = None
        """The process and this side's end of its pipe, while it runs: the two live and die together."""

    def ask(self, request: object, timeout_s: float) -> tuple[str, object]:
        """Send a request to the process (started if there is none) and wait for its answer: the process's; or
        ("overran", None) or ("ended", exit code) where none came. The process is killed wherever its state is
        unknown: it overran, it ended, the wait was interrupted."""
        process, connection = self._running if self._running and self.running() else self._start()
        answer: tuple[str, object]
        try:
            connection.send(request)
            if connection.poll(timeout_s):
                return connection.recv()
            answer = ("overran", None)
        except (EOFError, ConnectionError):  # it ended before answering, or before reading the request
            answer = ("ended", process.wait())
        except BaseException:  # Ctrl-C while waiting: an answer may still come, to the next request
            self.stop()
            raise
        self.stop()
        return answer

    def running(self) -> bool:
        return self._running is not None and self._running[0].poll() is None

    def _start(self) -> tuple[subprocess.Popen, Connection]:
        self.stop()
        connection, theirs = Pipe()
        environment = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}  # where it finds dovetail, as the caller
        process = subprocess.Popen(
            [sys.executable, "-c", self.program, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=environment
        )
        self._running = process, connection
        theirs.close()  # its end lives in the process alone: when the process ends, recv() here sees EOF
        try:
            connection.recv()  # its "ready": the interpreter is up, so the first call's clock starts now
        except EOFError:
            exit_code = process.wait()
            self.stop()
            raise Failed(f"could not start its process (exit code {exit_code})") from None
        return self._running

    def stop(self) -> None:
        if self._running is not None:
            process, connection = self._running
            process.kill()
            process.wait()
            connection.close()
            self._running = None


SERVE = "import sys; from dovetail.rewards.process import serve; serve(int(sys.argv[1]))"
"""The reward process's program; its argument is the descriptor of its end of the pipe."""

_rewards = Server(SERVE)


def call(name: str, args: tuple, kwargs: dict, samples: int, timeout_s: float):
    """The reward `name` ("package.module:function") called on `args` and `kwargs` (an image reward's by position,
    a text reward's by keyword), `samples` samples, in the reward process: its output, or Raised / Failed. One call
    at a time: a second caller waits for the first."""
    with _rewards.lock:
        outcome, detail = _rewards.ask((name, args, kwargs, (os.getcwd(), sys.path, dict(os.environ))), timeout_s)
    if outcome == "returned":
        return detail
    if outcome == "raised":
        raise Raised(detail)
    if outcome == "overran":
        raise Failed(
            f"took longer than reward_timeout_s={timeout_s:g} s on {samples} samples and was stopped; make it "
            "faster, or raise reward_timeout_s in the config"
        )
    if outcome == "ended":
        raise Failed(f"ended its process (exit code {detail}); a reward must return its scores, not exit")
    raise Failed(str(detail))


def serve(descriptor: int) -> None:
    """The reward process: answer each (name, args, kwargs, the caller's surroundings) on the pipe with ("returned",
    output), ("raised", "Type: message") or ("failed", how), until the caller's end closes (the caller ended, or
    let it go)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(descriptor)
    rewards = {}
    connection.send(("ready", None))
    while True:
        try:
            name, args, kwargs, (directory, path, environment) = connection.recv()
        except EOFError:
            return
        try:
            os.chdir(directory)
            sys.path[:] = path
            os.environ.clear()
            os.environ.update(environment)
            if name not in rewards:
                module, _, attribute = name.partition(":")
                rewards[name] = getattr(importlib.import_module(module), attribute)
            output = rewards[name](*args, **kwargs)
        except BaseException as error:  # SystemExit and KeyboardInterrupt too: they are the reward's failure
            connection.send(("raised", describe(error)))
            continue
        try:
            connection.send(("returned", output))
        except Exception as error:  # pickling it failed, before anything was written
            connection.send(
                ("failed", f"returned a {type(output).__name__} that cannot leave its process ({describe(error)})")
            )


def describe(error: BaseException) -> str:
    """ "Type: message" of an error, on one line ("Type" alone where it has no message)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
