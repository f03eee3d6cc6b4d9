"""Running a model's Python code (`run_python`), in a child interpreter that this file also is (run as a script).

The child is a fresh, isolated interpreter (`python -I -S -B -u`: no site-packages, no user paths, no environment
variables read, no bytecode written, its output unbuffered so that what it prints and its errors keep their order) in
a scratch directory of its own, deleted after the call. Before the code runs
it limits itself (`resource`): CPU seconds (the kernel stops it), address space (an allocation past it is a
MemoryError), the size of any file it writes, its output included (the kernel refuses the write), and no core dump;
the parent stops it after its wall-clock seconds, whatever it does (sleeping spends no CPU), and keeps its first
`output_bytes` of output. Then it installs an audit hook (`sys.addaudithook`, which nothing can remove) that refuses
sockets (no network), starting or signalling processes, loading native code (ctypes) and any file operation outside
the scratch directory (the standard library's files stay readable, for imports).

Every refusal and every limit comes back as the call's text, clear to the model: "error: ...". None is an exception
in the run. The audit hook keeps a model's code from reaching what it should not by accident or by a plain try; it
is not a boundary against code written to escape it (CPython's audit hooks are not one): run a run whose model may
write such code in a container without network."""

import ast
import errno
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback

REFUSED_EVENTS = {
    "subprocess.Popen": "starting a process",
    "os.system": "starting a process",
    "os.exec": "starting a process",
    "os.posix_spawn": "starting a process",
    "os.spawn": "starting a process",
    "os.fork": "starting a process",
    "os.forkpty": "starting a process",
    "pty.spawn": "starting a process",
    "os.kill": "signalling a process",
    "os.killpg": "signalling a process",
}
REFUSED_PREFIXES = {"socket.": "network access", "ctypes.": "loading native code"}
UNCHECKED_OS_EVENTS = {"os.putenv", "os.unsetenv"}
"""os.* events whose string arguments are no paths; every other os.* and shutil.* event's are checked."""
LISTING_EVENTS = {"os.listdir", "os.scandir", "os.walk"}
"""What import reads besides files: the standard library's directories may be listed."""
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def run_python(code: str, *, cpu_s: float, wall_s: float, memory_mb: int, output_bytes: int, file_bytes: int) -> str:
    """What `code` prints (stdout and stderr together, and the value of its last line where that is an expression,
    as a notebook shows it), run in the child within its limits; or what stopped it. The kernel counts CPU time in
    whole seconds: `cpu_s` is rounded up, to 1 at least."""
    cpu_seconds = max(1, math.ceil(cpu_s))
    limits = {"cpu_s": cpu_seconds, "memory_mb": memory_mb, "file_bytes": file_bytes}
    with tempfile.TemporaryDirectory(prefix="dovetail-sandbox-") as root:
        scratch = os.path.join(root, "scratch")
        os.mkdir(scratch)
        with open(os.path.join(root, "output"), "w+b") as output:
            try:
                child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", __file__, json.dumps(limits)],
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    cwd=scratch,
                    env={"TMPDIR": scratch},
                    start_new_session=True,  # its own process group, killed whole
                )
            except OSError as error:
                return f"error: the sandbox could not start ({error.strerror})"
            try:
                child.communicate(code.encode("utf-8", "replace"), timeout=wall_s)
                overran = False
            except subprocess.TimeoutExpired:
                overran = True
            finally:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.wait()
            output.seek(0)
            printed = output.read(output_bytes + 1)
    text = printed[:output_bytes].decode("utf-8", "replace")
    if len(printed) > output_bytes:
        text += f"\n[output cut at {output_bytes} bytes]"
    if overran:
        return _then(text, f"error: stopped after {wall_s:g} s of wall-clock time, its limit")
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return _then(text, f"error: stopped after {cpu_seconds} s of CPU time, its limit")
    return text.rstrip()


def _then(text: str, error: str) -> str:
    return f"{text.rstrip()}\n{error}" if text.strip() else error


# ------------------------------------------------------------------------------------------ the child


def _inside(path: object, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(os.fsdecode(path))  # type: ignore[arg-type]  # a path the audit event names
    return any(real == root or real.startswith(root + os.sep) for root in roots)


def _guard(scratch: str, readable: tuple[str, ...]):
    """The audit hook: every refused operation raises PermissionError("sandbox: ..."), which the code may catch,
    but which does not happen."""

    def refuse(what: str, event: str):
        raise PermissionError(f"sandbox: {what} is not allowed ({event})")

    def hook(event: str, args: tuple) -> None:
        if event in REFUSED_EVENTS:
            refuse(REFUSED_EVENTS[event], event)
        for prefix, what in REFUSED_PREFIXES.items():
            if event.startswith(prefix):
                refuse(what, event)
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):  # a descriptor it already holds
                return
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
            if _inside(path, (scratch,)) or (not writes and _inside(path, readable)):
                return
            refuse(f"opening {os.fsdecode(path)} (outside the scratch directory)", event)
        if event.startswith(("os.", "shutil.")) and event not in UNCHECKED_OS_EVENTS:
            roots = (scratch, *readable) if event in LISTING_EVENTS else (scratch,)
            for path in args:
                if isinstance(path, str | bytes | os.PathLike) and not _inside(path, roots):
                    refuse(f"{event} on {os.fsdecode(path)} (outside the scratch directory)", event)

    return hook


def _child(limits: dict) -> None:
    """Read the code, limit this process, install the guard, run the code in a fresh `__main__` namespace."""
    code = sys.stdin.read()
    scratch = os.path.realpath(os.getcwd())
    readable = tuple(os.path.realpath(p) for p in sys.path if p)
    cpu, memory = limits["cpu_s"], limits["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.addaudithook(_guard(scratch, readable))
    namespace = {"__name__": "__main__"}
    try:
        tree = ast.parse(code, "<python>")
    except SyntaxError as error:
        traceback.print_exception(type(error), error, None)
        sys.exit(1)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    assert last is None or isinstance(last, ast.Expr)
    try:
        exec(compile(tree, "<python>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<python>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except MemoryError:
        print(f"MemoryError: the code went over its memory limit of {limits['memory_mb']} MB", file=sys.stderr)
        sys.exit(1)
    except BaseException as error:
        refusal = _refusal_in(error)
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr)
        elif isinstance(error, OSError) and error.errno == errno.EFBIG:
            print(f"error: the code wrote a file past its limit of {limits['file_bytes']} bytes", file=sys.stderr)
        else:  # the code's own traceback, without this function's frame
            traceback.print_exception(type(error), error, error.__traceback__.tb_next if error.__traceback__ else None)
        sys.exit(1)


def _refusal_in(error: BaseException | None) -> PermissionError | None:
    """The guard's refusal that caused `error` (a library may wrap it: urllib's URLError), if one did."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, PermissionError) and str(error).startswith("sandbox:"):
            return error
        error = error.__cause__ or error.__context__
    return None


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
