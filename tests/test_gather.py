"""A commit's gather (`exec.worker.gather_parts`): every trainer device ends with every device's train parts, the
same bits under the same keys, whatever number of parts each holds (none included); and its reduction
(`exec.worker.reduce_parts`), for parts that add up in any order: the same bits as adding every part in key order."""

import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dovetail.exec.worker import gather_parts, reduce_parts

NUMEL = 1000
HELD = {0: [("train-b", 1), ("train-a", 0)], 1: [("train-c", 0)], 2: []}
"""Which parts each of three devices trained: uneven, one device none (a device that only generated)."""


def part(key: tuple[str, int]) -> torch.Tensor:
    """A part's gradient, from its key alone, so every process knows what every other one holds."""
    generator = torch.Generator().manual_seed(zlib.crc32(key[0].encode()) + key[1])
    return torch.randn(NUMEL, generator=generator, dtype=torch.float64)


def language_model_part(key: tuple[str, int]) -> torch.Tensor:
    """A language-model part as `models.lm_rl` makes one: fp32 group gradients, of magnitudes 2^-20 to 2^4 (a span
    within 2^29), added in fp64."""
    generator = torch.Generator().manual_seed(zlib.crc32(key[0].encode()) + key[1])
    groups = torch.randn(3, NUMEL, generator=generator) * 2.0 ** torch.randint(-20, 5, (3, NUMEL), generator=generator)
    return groups.to(torch.float64).sum(0)


def gather_on(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(HELD))
    try:
        gathered = gather_parts({key: part(key) for key in HELD[rank]}, (0, 1, 2), {}, torch.device("cpu"))
        expected = [key for keys in HELD.values() for key in keys]
        assert sorted(gathered) == sorted(expected)
        for key in expected:
            assert gathered[key].dtype == torch.float64 and torch.equal(gathered[key], part(key))
        in_key_order = torch.zeros(NUMEL, dtype=torch.float64)
        for key in sorted(expected):
            in_key_order += language_model_part(key)
        held = {key: language_model_part(key) for key in HELD[rank]}
        reduced = reduce_parts(held, (0, 1, 2), {}, torch.zeros(NUMEL, dtype=torch.float64))
        assert torch.equal(reduced, in_key_order)
    finally:
        dist.destroy_process_group()


def test_every_device_gathers_every_part_bit_for_bit_and_reduces_to_the_key_ordered_sum(tmp_path):
    mp.spawn(gather_on, args=(str(tmp_path / "store"),), nprocs=len(HELD))


def test_a_device_alone_keeps_its_own_parts():
    parts = {("train", 0): part(("train", 0))}
    assert gather_parts(parts, (0,), {}, torch.device("cpu")) is parts
