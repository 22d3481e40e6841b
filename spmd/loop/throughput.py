"""Throughput and MFU of a logged step, for metrics.jsonl and the trackers.

Why here: MFU needs the task's FLOPs per example (`Task.flops_per_example`, None when the task
does not know them), the global batch, the step time and the devices' peak; the metrics hook
has all of these, the task and the rundir layer do not. MFU is only reported where the peak of
the device kind is known (the table below: dense bf16, the usual convention), so a CPU run logs
`model_flops_per_s` but no `mfu`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 peak FLOP/s per device, by device kind (substring match, first wins); the same
# figures benchmarks/gpu_mfu.py uses.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12),
              ("MI300", 1307e12), ("MI250", 383e12))


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind, or None when unknown."""
    for name, peak in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return peak
    return None


@dataclass(frozen=True)
class FlopRate:
    """The model FLOP/s and MFU of a step from its time (global batch, all devices)."""

    flops_per_step: float          # the task's FLOPs per example x global batch
    devices: int
    peak_per_device: float | None  # None: MFU unknown

    def of(self, step_time_s: float) -> dict[str, float]:
        rate = self.flops_per_step / step_time_s
        out = {"model_flops_per_s": rate}
        if self.peak_per_device:
            out["mfu"] = rate / (self.devices * self.peak_per_device)
        return out

    @staticmethod
    def create(flops_per_example: float | None, batch: int, devices: int,
               device_kind: str) -> FlopRate | None:
        """None when the task gives no FLOPs (nothing to log)."""
        if not flops_per_example:
            return None
        return FlopRate(flops_per_example * batch, devices, peak_flops(device_kind))
