"""The decode step's clock: wall seconds of its parts, for the step profile and a speculation policy's cost model.

On CUDA, kernels run behind the host: a part's time is its device time only if the clock waits for the device
first, and that wait serialises the launches CUDA graphs exist to overlap. So the clock synchronises only when
something reads device time: a policy that learns from it (adaptive speculation) or the profiling flag
(`EngineConfig.profile_steps`). Otherwise it reads host time alone, and the step profile books a part's device
time to whatever waits on it next. On a CPU, host time is device time and nothing waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepClock:
    device: torch.device
    reads_device_time: bool  # a policy or the profiling flag needs each part's device time

    def __call__(self) -> float:
        if self.reads_device_time and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
