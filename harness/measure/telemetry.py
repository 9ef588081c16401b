"""GPU telemetry through NVML: clocks, power, temperature and clock-event (throttle) reasons.

Sampled before and after each timed point, and polled in a background thread while it is timed; a
point during which a thermal, power or hardware slowdown bit was seen is flagged (with the share of
polls that saw one and the lowest SM clock), since its timings may not reflect the GPU at its
normal clocks.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*): the ones that mean "slowed down".
SLOWDOWN_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
OTHER_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x10: "sync_boost",
              0x100: "display_clock_setting"}


def reason_names(mask: int) -> list[str]:
    names = {**SLOWDOWN_BITS, **OTHER_BITS}
    return [name for bit, name in sorted(names.items()) if mask & bit]


def is_throttled(mask: int) -> bool:
    return any(mask & bit for bit in SLOWDOWN_BITS)


@dataclass
class Telemetry:
    """One GPU's NVML handle, or the reason there is none (`available` False)."""
    available: bool
    reason: str = ""
    _handle: object = None

    def clock_reasons(self) -> int:
        """NVML's current clock-event reason mask (0 when unavailable)."""
        if not self.available:
            return 0
        import pynvml as nv
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(get_reasons(self._handle))

    def max_sm_clock_mhz(self) -> float | None:
        """The GPU's maximum SM clock (nvmlDeviceGetMaxClockInfo): the reference of clock-normalized times."""
        if not self.available:
            return None
        import pynvml as nv
        try:
            return float(nv.nvmlDeviceGetMaxClockInfo(self._handle, nv.NVML_CLOCK_SM))
        except Exception:
            return None

    @property
    def nvml_handle(self):
        return self._handle

    def sample(self) -> dict:
        if not self.available:
            return {}
        import pynvml as nv
        h = self._handle
        mask = self.clock_reasons()
        return {"sm_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                "mem_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "temperature_c": float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                "clock_event_reasons": mask}


def open_telemetry(device) -> Telemetry:
    """NVML for the CUDA device `device`; on CPU or without NVML an unavailable Telemetry saying why."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return Telemetry(False, "telemetry unavailable: not a CUDA device")
    try:
        import pynvml as nv
        nv.nvmlInit()
    except Exception as exc:  # ImportError or an NVMLError (no driver library)
        return Telemetry(False, f"telemetry unavailable: NVML could not start ({exc})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        # Match by UUID: the CUDA index differs from NVML's under CUDA_VISIBLE_DEVICES.
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            return Telemetry(False, "telemetry unavailable: could not match the CUDA device to NVML by UUID")
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    return Telemetry(True, "", handle)


@dataclass
class Poller:
    """Calls `sample` every `interval_s` in a daemon thread between start() and stop(); keeps the samples."""
    sample: object
    interval_s: float = 0.1
    samples: list = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = None

    def _loop(self):
        while not self._stop.is_set():
            try:
                s = self.sample()
            except Exception:   # a failed NVML read must not kill the timing; the poll is just lost
                s = None
            if s:
                self.samples.append(s)
            self._stop.wait(self.interval_s)

    def start(self) -> "Poller":
        self._thread = threading.Thread(target=self._loop, name="msa-bench-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.samples


def point_telemetry(before: dict, after: dict, during: list | None = None) -> dict:
    """Flat columns for one timed point: both samples, a summary of the polls taken while it was
    timed, the union of reasons and the throttle flag."""
    during = during or []
    if not before and not after and not during:
        return {"telemetry": "unavailable"}
    row = {"telemetry": "nvml"}
    for tag, sample in (("before", before), ("after", after)):
        for key, value in sample.items():
            row[f"{key}_{tag}"] = value
    mask = int(before.get("clock_event_reasons", 0)) | int(after.get("clock_event_reasons", 0))
    if during:
        masks = [int(s.get("clock_event_reasons", 0)) for s in during]
        for m in masks:
            mask |= m
        row.update(polls=len(during),
                   slowdown_poll_share=sum(is_throttled(m) for m in masks) / len(masks),
                   sm_clock_min_mhz=min(s["sm_clock_mhz"] for s in during),
                   power_max_w=max(s["power_w"] for s in during),
                   temperature_max_c=max(s["temperature_c"] for s in during))
    row["clock_event_names"] = ",".join(reason_names(mask))
    row["throttled"] = is_throttled(mask)
    return row
