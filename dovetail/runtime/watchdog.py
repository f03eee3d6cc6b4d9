"""A local run's Ray processes die with their driver.

Ray ties its GCS server and raylet (and through them the workers) to the driver that started a local instance, but
not the agents the raylet starts (dashboard and runtime-env agents): a driver killed with SIGKILL (the out-of-memory
killer, `kill -9`, a scheduler past its grace period) leaves them running, and every leftover of a dead run slows
the next one on a machine of two cores. So `start_watchdog` starts this module as a process of its own session (no
terminal signal reaches it) reading a pipe only the driver holds: the pipe ends when the driver does, however it
ends, and the watchdog then kills every process it has seen below the driver.
"""

import os
import select
import subprocess
import sys

import psutil

POLL_S = 1.0
"""How often the watchdog looks at the driver's descendants: a worker started and killed within one poll is not
seen, but Ray's own processes live as long as the instance."""


def start_watchdog() -> subprocess.Popen:
    """Start the watchdog of this process; keep the returned handle for the life of the process (its pipe is the
    driver's heartbeat)."""
    return subprocess.Popen(
        [sys.executable, "-m", "dovetail.runtime.watchdog", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def watch(driver_pid: int, heartbeat) -> None:
    """Until `heartbeat` ends (the driver exited), remember the driver's descendants; then kill them."""
    seen: dict[int, psutil.Process] = {}
    me = os.getpid()
    try:
        driver = psutil.Process(driver_pid)
        while not select.select([heartbeat], [], [], POLL_S)[0]:
            seen |= {p.pid: p for p in driver.children(recursive=True) if p.pid != me}
    except psutil.NoSuchProcess:
        pass
    for process in seen.values():
        try:
            process.kill()  # psutil checks the process is still the one seen (pid and start time)
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.stdin)
