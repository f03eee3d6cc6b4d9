"""A commit's reduction (`runtime.worker.reduce_parts`): each device adds its own train parts into one fp64 sum as they
finish, in any order, and one all-reduce adds the devices' sums, whatever number of parts each holds (none included):
the same bits as adding every part in key order, for fp32 gradients added in fp64 within the span the argument allows,
and not beyond it."""

import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dovetail.runtime.worker import reduce_parts, replica_ranks

NUMEL = 1000
HELD = {0: [("train-c", 0), ("train-a", 0)], 1: [("train-b", 1)], 2: []}
"""Which parts each of three devices trained: uneven, one device none (a device that only generated), and not in key
order (device 0 holds the first and the last key): a reduction adds (a + c) + b where the key order adds (a + b) + c."""


def part(key: tuple[str, int], lowest: int = -20) -> torch.Tensor:
    """A part as a trainer makes one: three fp32 gradients added in fp64 (a language model's groups; a flow part is
    one), each term of magnitude 2^lowest to 2^5, from the key alone, so every process knows what every other one
    holds. From the default lowest, 2^-20, the terms span 25 bits, and nine of them add exactly in fp64's 53 (24 bits
    of fp32 mantissa, 4 of carries): the argument the reduction rests on."""
    generator = torch.Generator().manual_seed(zlib.crc32(key[0].encode()) + key[1])
    magnitude = (1 + torch.rand(3, NUMEL, generator=generator)) * 2.0 ** torch.randint(
        lowest, 5, (3, NUMEL), generator=generator
    )
    sign = torch.randint(0, 2, (3, NUMEL), generator=generator) * 2 - 1
    return (magnitude * sign).to(torch.float64).sum(0)


def reduce_on(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(HELD))
    try:
        every_key = sorted(key for keys in HELD.values() for key in keys)
        for lowest, same_bits in ((-20, True), (-120, False)):  # beyond the argument's span, the order shows
            in_key_order = torch.zeros(NUMEL, dtype=torch.float64)
            for key in every_key:
                in_key_order += part(key, lowest)
            total = torch.zeros(NUMEL, dtype=torch.float64)
            for key in HELD[rank]:  # as they finished: not in key order
                total += part(key, lowest)
            reduced = reduce_parts(total, (0, 1, 2), {})
            assert torch.equal(reduced, in_key_order) == same_bits, lowest
    finally:
        dist.destroy_process_group()


def test_the_devices_parts_reduce_to_the_key_ordered_sum_within_the_span_of_the_argument(tmp_path):
    mp.spawn(reduce_on, args=(str(tmp_path / "store"),), nprocs=len(HELD))


def test_a_device_alone_keeps_the_sum_of_its_parts_in_any_order():
    expected, total = torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL, dtype=torch.float64)
    for key in sorted(HELD[0]):
        expected += part(key)
    for key in HELD[0]:
        total += part(key)
    assert torch.equal(reduce_parts(total, (0,), {}), expected)


def test_a_hybrid_member_reduces_with_the_members_at_its_place_in_the_other_groups():
    """`replica_ranks`: trainer devices 0-5 cut into FSDP groups of two, (0, 1) (2, 3) (4, 5), each a replica; device 3
    holds the second shard, as 1 and 5 do. One group: a member alone. Groups that are not consecutive devices of one
    size are refused in one line."""
    assert replica_ranks((0, 1, 2, 3, 4, 5), (2, 3), 3) == (1, 3, 5)
    assert replica_ranks((0, 1, 2, 3, 4, 5), (0, 1), 0) == (0, 2, 4)
    assert replica_ranks((0, 1), (0, 1), 1) == (1,)
    assert replica_ranks((3, 7), (7,), 7) == (3, 7)
    with pytest.raises(RuntimeError, match="are not cut into FSDP groups like"):
        replica_ranks((0, 1, 2, 3), (1, 2), 1)
