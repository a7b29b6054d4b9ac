"""DTensor helpers every layer uses."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_shard(t: Tensor) -> Tensor:
    """The block this rank holds: a DTensor's local tensor (a view: in-place updates reach it), else t."""
    return t.to_local() if isinstance(t, DTensor) else t
