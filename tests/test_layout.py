"""held_ranges: the global rows a rank holds, for any nesting of Shard / _StridedShard.

Ground truth is DTensor itself: ``distribute_tensor(arange, ..., src_data_rank=None)`` splits
locally with DTensor's own placement code (no communication), here for every rank of a fake
process group in turn; the rank's local tensor then lists the global rows it holds.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_muon.layout import held_ranges

PLACEMENTS = {
    (2, 2): [
        (Shard(0), Shard(0)),
        (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP2 on top of tensor parallel
        (Replicate(), Shard(0)),  # tensor parallel only, or HSDP replicate × TP
        (Shard(0), Replicate()),
        (Shard(1), Shard(0)),  # a column shard leaves every row in place
    ],
    (2, 2, 2): [
        (Replicate(), _StridedShard(0, split_factor=2), Shard(0)),  # HSDP on top of tensor parallel
        (_StridedShard(0, split_factor=4), Shard(0), Shard(0)),
        (Shard(0), _StridedShard(0, split_factor=2), Shard(0)),
    ],
}


@pytest.mark.parametrize("mesh_shape", sorted(PLACEMENTS))
def test_held_ranges_match_dtensor_sharding(mesh_shape):
    world = 1
    for size in mesh_shape:
        world *= size
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            for rows in (16, 13, 3, 30, 0):  # even, uneven, fewer rows than shards, empty
                for placements in PLACEMENTS[mesh_shape]:
                    rows_index = torch.arange(rows).repeat_interleave(2).view(rows, 2)
                    shard = distribute_tensor(rows_index, mesh, placements, src_data_rank=None)
                    held = [i for start, end in held_ranges(shard) for i in range(start, end)]
                    assert held == shard.to_local()[:, 0].tolist(), (rank, rows, placements)
        finally:
            dist.destroy_process_group()


def test_a_plain_tensor_holds_every_row():
    assert held_ranges(torch.zeros(7, 3)) == [(0, 7)]
    assert held_ranges(torch.zeros(7, 3), dim=1) == [(0, 3)]
