"""Run torchtitan 0.2.2's trainer on CPU processes talking over gloo.

torchtitan assumes an accelerator: it reads the device type once, at import, from
``torch._utils._get_available_device_type() or "cuda"``, so a CPU-only machine is
treated as CUDA. Everything needed to train without a GPU lives in this module:

1. :func:`use_cpu_device` points the module-level ``device_type`` / ``device_module``
   names at the CPU. There is no extension point for this, so it rebinds those names in
   the few torchtitan modules that imported them. It must run before the trainer is
   built (the launcher does it first thing).
2. :func:`force_sum_reductions` makes FSDP2 reduce gradients with plain SUM. torchtitan
   disables FSDP's gradient division (it divides the loss by the global token count
   instead); FSDP then asks for ``PREMUL_SUM(1.0)``, which gloo does not implement.
   With a divide factor of 1, a SUM reduction is exactly the same math.
3. :func:`use_cpu_device` also lets torchtitan's MoE layer run (:func:`count_integers_on_cpu`,
   :func:`permute_tokens_on_cpu`): it counts tokens per expert with ``torch.histc`` on the
   integer expert indices, which torch implements on CUDA but not on CPU, and with expert
   parallel it lays tokens out per expert with a Triton kernel (``generate_permute_indices``)
   whose CPU version torchtitan ships but does not select.
4. :func:`use_cpu_device` also lets ``[checkpoint] async_mode = "async_with_pinned_mem"`` run
   (:func:`stage_checkpoints_without_accelerator`): torchtitan builds torch's ``DefaultStager``
   with pinned memory and non-blocking copies, which torch refuses without an accelerator. On
   the CPU the stager keeps the rest of that mode: the copy into shared memory on a background
   thread while the next step's forward and backward run (torchtitan waits for it before the
   optimizer step), and the write from a separate process.

On a CUDA machine none of this is used.
"""

import dataclasses
import functools
import importlib
import os
import resource

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


class CPUDeviceModule:
    """The slice of the ``torch.cuda`` API that torchtitan calls, answered for the CPU.

    Memory figures are the process's peak resident set size: a CPU has no caching
    allocator, so "active" and "reserved" are the same number, and peaks cannot be reset.
    """

    def set_device(self, device: torch.device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self) -> None:
        pass

    def get_device_name(self, device: torch.device | None = None) -> str:
        return "CPU"

    def get_device_properties(self, device: torch.device | None = None):
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CPUProperties", (), {"total_memory": total_memory})()

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak_rss,
            "reserved_bytes.all.peak": peak_rss,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


def should_use_cpu() -> bool:
    return not torch.cuda.is_available()


def use_cpu_device() -> None:
    """Rebind torchtitan's import-time device choice to the CPU (and thus gloo), and let its
    MoE layer run there."""
    rebind_device(
        (
            "torchtitan.tools.utils",
            "torchtitan.distributed.utils",
            "torchtitan.distributed.parallel_dims",
            "torchtitan.components.metrics",
            "torchtitan.tools.profiling",
        )
    )
    count_integers_on_cpu()
    permute_tokens_on_cpu()
    stage_checkpoints_without_accelerator()


def rebind_device(module_names) -> None:
    """Point the ``device_type`` / ``device_module`` names of these torchtitan modules at the CPU.

    torchtitan 0.2.2 and 0.3.0 both read the device once, at import, and the modules that use it
    import the two names; each module listed is imported here (if not yet) and its names rebound.
    """
    device_module = CPUDeviceModule()
    for name in module_names:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module


def count_integers_on_cpu() -> None:
    """Give ``torch.histc`` the integer CPU inputs it lacks ("histogram_cpu" not implemented
    for 'Long'), as CUDA has them: the counts come out in the input's dtype, so torchtitan's
    token counts per expert stay integers (expert parallel's all-to-all splits need ints).

    Every input torch already handles goes to torch's own ``histc`` unchanged. Integer
    inputs are counted in float64, where every integer of a bin's range is exact (torchtitan
    counts expert indices 0..E-1 into E bins of width 1) and counts up to 2**53 are too.
    """
    original = torch.histc
    if getattr(original, "counts_integers_on_cpu", False):
        return

    @functools.wraps(original)
    def histc(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 (torch's names)
        if out is None and input.device.type == "cpu" and not input.is_floating_point() and not input.is_complex():
            return original(input.double(), bins=bins, min=min, max=max).to(input.dtype)
        kwargs = {} if out is None else {"out": out}
        return original(input, bins=bins, min=min, max=max, **kwargs)

    histc.counts_integers_on_cpu = True
    torch.histc = histc


def permute_tokens_on_cpu() -> None:
    """Expert parallel's token layout (``torchtitan.models.moe.utils._permute``) calls
    ``generate_permute_indices`` with its Triton kernel; torchtitan's own CPU implementation
    of it is selected by ``use_cpu=True``. Rebinds the name that utils imported."""
    utils = importlib.import_module("torchtitan.models.moe.utils")  # torchtitan 0.2.x
    kernels = importlib.import_module("torchtitan.models.moe.kernels")
    utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)


def stage_checkpoints_without_accelerator(module_name: str = "torchtitan.components.checkpoint") -> None:
    """torchtitan builds ``DefaultStager(StagingOptions(True, True, True, True))`` for
    ``async_with_pinned_mem`` (0.2.x in ``torchtitan.components.checkpoint``, 0.3.0 in
    ``torchtitan.components.checkpointer.dcp``); without an accelerator torch refuses non-blocking
    copies ("Non-blocking copy requires that the current accelerator is available") and has no
    pinned memory. Rebinds the name that module imported to one that turns those two options off
    when no accelerator is available and keeps shared memory and async staging."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    checkpoint = importlib.import_module(module_name)
    original = checkpoint.DefaultStager
    if getattr(original, "stages_without_accelerator", False):
        return

    def stager(config: StagingOptions | None = None) -> DefaultStager:
        config = StagingOptions() if config is None else config
        if not torch.accelerator.is_available():
            config = dataclasses.replace(config, use_pinned_memory=False, use_non_blocking_copy=False)
        return original(config)

    stager.stages_without_accelerator = True
    checkpoint.DefaultStager = stager


def force_sum_reductions(model_parts: list[nn.Module]) -> None:
    for model in model_parts:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
