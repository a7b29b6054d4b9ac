"""Suite-wide settings, read from the environment (see docs/reliability.md, "Portability"):

    TITAN_MUON_TEST_THREADS=N        intra-op threads of the pytest process and of every rank
                                     (spawned gloo ranks and torchrun workers); default 1
    TITAN_MUON_TEST_DETERMINISTIC=1  torch.use_deterministic_algorithms(True) in the pytest
                                     process and in every spawned rank (not in torchrun workers)

The pytest process computes the one-process references, so it uses the ranks' thread count.
"""

import os
import platform

import torch
from distributed import THREADS_VARIABLE, apply_test_settings, deterministic_mode, threads_per_process


def pytest_configure(config):
    apply_test_settings()
    # torchrun sets OMP_NUM_THREADS=1 for its workers only when it is unset and a node runs
    # several ranks; set it for every launch, so one-rank nodes get the same thread count.
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process())


def pytest_report_header(config):
    return (
        f"titan_muon: {THREADS_VARIABLE}={threads_per_process()} deterministic={deterministic_mode()} "
        f"cpu={_cpu_model()!r} capability={torch.backends.cpu.get_cpu_capability()}"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
