"""Where a device group meets: Ray's own key-value store.

torch.distributed needs a store that every member of a group reaches to exchange addresses once, at forming (and
again when a trainer sub-group is cut from it). Torch's TCP store would live in one member's process and listen on
every interface, unauthenticated: the group could not form again after that member's device is lost, and a cluster
would expose one more port. Ray's key-value store lives in Ray's control store on the head node, survives any
device, needs no port of its own and is behind Ray's token authentication like the rest of the cluster. A forming
writes under a key prefix of its own, and the members delete their previous group's keys once they have left it.
Only the rendezvous goes through it: the collectives then connect the members directly (gloo or NCCL).
"""

import time
from datetime import timedelta

import torch.distributed as dist
from ray.experimental import internal_kv

NAMESPACE = "dovetail-groups"
"""Ray key-value namespace of the rendezvous keys."""
POLL_S = 0.005


class RayStore(dist.Store):
    """A torch.distributed store on Ray's key-value store under `prefix`: set and get, which is all a gloo or NCCL
    group's forming and sub-group creation ask of it. A get waits for its key for at most `timeout` (a member that
    never comes is an error, not a hang)."""

    def __init__(self, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self.prefix = prefix
        self.timeout_s = timeout.total_seconds()

    def _key(self, key: str) -> bytes:
        return f"{self.prefix}/{key}".encode()

    def set(self, key: str, value) -> None:
        data = value if isinstance(value, bytes) else str(value).encode()
        internal_kv._internal_kv_put(self._key(key), data, overwrite=True, namespace=NAMESPACE)

    def get(self, key: str) -> bytes:
        end = time.monotonic() + self.timeout_s
        while (value := internal_kv._internal_kv_get(self._key(key), namespace=NAMESPACE)) is None:
            if time.monotonic() > end:
                raise TimeoutError(f"rendezvous {self.prefix}: no member wrote {key!r} within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        return value

    def check(self, keys: list[str]) -> bool:
        return all(internal_kv._internal_kv_exists(self._key(key), namespace=NAMESPACE) for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key)


def forget(prefix: str) -> None:
    """Delete a group's rendezvous keys (its members have all left it)."""
    internal_kv._internal_kv_del(f"{prefix}/".encode(), del_by_prefix=True, namespace=NAMESPACE)
