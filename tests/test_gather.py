"""A commit's gather (`exec.worker.gather_parts`): every trainer device ends with every device's train parts, the
same bits under the same keys, whatever number of parts each holds (none included); and its reduction
(`exec.worker.reduce_parts`), for parts that add up in any order: the same bits as adding every part in key order."""

import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dovetail.exec.worker import gather_parts, reduce_parts

NUMEL = 1000
HELD = {0: [("train-c", 0), ("train-a", 0)], 1: [("train-b", 1)], 2: []}
"""Which parts each of three devices trained: uneven, one device none (a device that only generated), and not in key
order (device 0 holds the first and the last key): a reduction adds (a + c) + b where the key order adds (a + b) + c."""


def part(key: tuple[str, int]) -> torch.Tensor:
    """A part's gradient, from its key alone, so every process knows what every other one holds."""
    generator = torch.Generator().manual_seed(zlib.crc32(key[0].encode()) + key[1])
    return torch.randn(NUMEL, generator=generator, dtype=torch.float64)


def language_model_part(key: tuple[str, int], lowest: int = -20) -> torch.Tensor:
    """A language-model part as `models.lm_rl` makes one: three fp32 group gradients added in fp64, each term of
    magnitude 2^lowest to 2^5. From the default lowest, 2^-20, the terms span 25 bits, and nine of them add exactly
    in fp64's 53 (24 bits of fp32 mantissa, 4 of carries): the argument the reduction rests on."""
    generator = torch.Generator().manual_seed(zlib.crc32(key[0].encode()) + key[1])
    magnitude = (1 + torch.rand(3, NUMEL, generator=generator)) * 2.0 ** torch.randint(
        lowest, 5, (3, NUMEL), generator=generator
    )
    sign = torch.randint(0, 2, (3, NUMEL), generator=generator) * 2 - 1
    return (magnitude * sign).to(torch.float64).sum(0)


def gather_on(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(HELD))
    try:
        gathered = gather_parts({key: part(key) for key in HELD[rank]}, (0, 1, 2), {}, torch.device("cpu"))
        expected = [key for keys in HELD.values() for key in keys]
        assert sorted(gathered) == sorted(expected)
        for key in expected:
            assert gathered[key].dtype == torch.float64 and torch.equal(gathered[key], part(key))
        for lowest, same_bits in ((-20, True), (-120, False)):  # beyond the argument's span, the order shows
            in_key_order = torch.zeros(NUMEL, dtype=torch.float64)
            for key in sorted(expected):
                in_key_order += language_model_part(key, lowest)
            held = {key: language_model_part(key, lowest) for key in HELD[rank]}
            reduced = reduce_parts(held, (0, 1, 2), {}, torch.zeros(NUMEL, dtype=torch.float64))
            assert torch.equal(reduced, in_key_order) == same_bits, lowest
    finally:
        dist.destroy_process_group()


def test_every_device_gathers_every_part_bit_for_bit_and_reduces_to_the_key_ordered_sum(tmp_path):
    mp.spawn(gather_on, args=(str(tmp_path / "store"),), nprocs=len(HELD))


def test_a_device_alone_keeps_its_own_parts():
    parts = {("train", 0): part(("train", 0))}
    assert gather_parts(parts, (0,), {}, torch.device("cpu")) is parts
