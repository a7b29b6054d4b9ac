"""Bytes of tensor storage allocated inside a block and still alive, measured independently of
the optimizer's own account: every op that returns a new tensor (not a view, not in place)
registers its storage, and a finalizer on the storage's Python object (which torch keeps as
long as the storage lives) subtracts it when the memory is released."""

import threading
import traceback
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode, and their peak (CPU tensors)."""
    def __init__(self, only_from: str | None = None):
        """`only_from`: count only storages allocated while code from files under this path runs."""
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = set()
        self.only_from = only_from
        # Bytes of storages whose last reference another thread dropped: gloo's worker thread
        # holds a collective's tensors until it has finished its bookkeeping, after waking the
        # waiter, so such a storage can still count as alive, for an instant, when the step's
        # next allocation sets the peak (seen here: a return buffer, in 3 of 128 steps).
        self.released_elsewhere = 0
        self._thread = threading.get_ident()
    def _freed(self, key, n):
        self.live -= n
        self._seen.discard(key)
        if threading.get_ident() != self._thread:
            self.released_elsewhere += n
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns):  # views and in-place ops allocate nothing
            return out
        if self.only_from is not None and not any(self.only_from in f.filename for f in traceback.extract_stack()):
            return out
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                try:
                    key = s.data_ptr()
                except RuntimeError:  # a storage FSDP2 has resized away (unsharded parameters)
                    continue
                if key and key not in self._seen and s.nbytes():
                    self._seen.add(key)
                    n = s.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._freed, key, n)
        return out


def allocator_peak(fn):
    """(peak bytes, largest single allocation, fn()) over every CPU allocation made while ``fn``
    runs, as torch's profiler records them from the allocator: unlike :class:`LiveBytes` it
    also sees what a kernel allocates for itself (an operand it copies, a GEMM's scratch)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = largest = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
        largest = max(largest, event.nbytes())
    return peak, largest, result
