"""Where a device group meets: Ray's own key-value store.

torch.distributed needs a store that every member of a group reaches to exchange addresses once, at forming (and
again when a trainer sub-group is cut from it). Torch's TCP store would live in one member's process and listen on
every interface, unauthenticated: the group could not form again after that member's device is lost, and a cluster
would expose one more port. Ray's key-value store lives in Ray's control store on the head node, survives any
device, needs no port of its own and is behind Ray's token authentication like the rest of the cluster. A forming
writes under a key prefix of its own, and the members delete their previous group's keys once they have left it.
Only the rendezvous goes through it: the collectives then connect the members directly (gloo or NCCL).

A member that died leaves the others waiting for keys it will never write (a trainer sub-group cut at a commit, say):
the driver marks its group abandoned (`abandon`) as soon as it learns of the death, and every wait of that group's
members ends within ABANDON_CHECK_S with `GroupAbandoned`, instead of the store's timeout, so they answer the revive
that forms the next group.
"""

import time
from datetime import timedelta

import torch.distributed as dist
from ray.experimental import internal_kv

NAMESPACE = "dovetail-groups"
"""Ray key-value namespace of the rendezvous keys."""
POLL_S = 0.005
ABANDONED = "abandoned"
"""The key, under a group's prefix, that says a member died: the group forms again under another prefix."""
ABANDON_CHECK_S = 0.2
"""How often a waiting member looks for its group's abandoned mark."""


class GroupAbandoned(RuntimeError):
    """A member of this device's group died while this one waited for it at a rendezvous."""


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
        now = time.monotonic()
        end, next_check = now + self.timeout_s, now + ABANDON_CHECK_S
        while (value := internal_kv._internal_kv_get(self._key(key), namespace=NAMESPACE)) is None:
            now = time.monotonic()
            if now > end:
                raise TimeoutError(f"rendezvous {self.prefix}: no member wrote {key!r} within {self.timeout_s:g} s")
            if now > next_check:
                if internal_kv._internal_kv_exists(self._key(ABANDONED), namespace=NAMESPACE):
                    raise GroupAbandoned(f"rendezvous {self.prefix}: a member died while this one waited for {key!r}")
                next_check = now + ABANDON_CHECK_S
            time.sleep(POLL_S)
        return value

    def check(self, keys: list[str]) -> bool:
        return all(internal_kv._internal_kv_exists(self._key(key), namespace=NAMESPACE) for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key)


def abandon(prefix: str) -> None:
    """Mark a group one of whose members died: its members stop waiting at its rendezvous (`RayStore.get`)."""
    internal_kv._internal_kv_put(f"{prefix}/{ABANDONED}".encode(), b"1", overwrite=True, namespace=NAMESPACE)


def forget(prefix: str) -> None:
    """Delete a group's rendezvous keys (its members have all left it)."""
    internal_kv._internal_kv_del(f"{prefix}/".encode(), del_by_prefix=True, namespace=NAMESPACE)
