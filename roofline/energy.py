"""Energy per launch against the board's power limit.

The lent H200s hold their power at the enforced limit while the attention stage runs (NVML flags
`sw_power_cap` on every measurement), so there a launch's time is set by its energy: a launch that
spends E joules above the board's idle draw can take no less than E / (P_limit - P_idle) seconds,
whatever its schedule. A TFLOP/s target therefore doubles as an energy budget: at target time
T* = FLOPs / target, the board can spend (P_limit - P_idle) x T* above idle. Pieces of work measured
on their own (a dense matmul of the same FLOPs, a plain write of the same bytes) each take their share
of that budget.

Two caveats, both stated wherever these numbers are printed:
- Energy per operation falls with the clock (lower voltage), so a piece measured at its own capped
  clock is an estimate of what it costs inside another kernel, not a bound.
- Idle draw at idle clocks understates the static draw under load, so the budget above idle is
  generous (it favours the target).
"""
from __future__ import annotations

from dataclasses import dataclass


def above_idle_j(joules: float, seconds: float, idle_w: float) -> float:
    """Energy a launch spent beyond what the idle board would have drawn over the same time."""
    return joules - idle_w * seconds


def cap_time_s(above_idle: float, power_limit_w: float, idle_w: float) -> float:
    """The shortest time a launch with this much energy above idle can take at the power limit."""
    if power_limit_w <= idle_w:
        raise ValueError(f"power limit {power_limit_w} W is not above the idle draw {idle_w} W")
    return above_idle / (power_limit_w - idle_w)


@dataclass(frozen=True)
class EnergyBudget:
    """What a TFLOP/s target allows per launch on a board capped at power_limit_w, idling at idle_w."""
    flops: float
    target_tflops: float
    power_limit_w: float
    idle_w: float

    @property
    def target_s(self) -> float:
        return self.flops / (self.target_tflops * 1e12)

    @property
    def joules_at_limit(self) -> float:
        return self.power_limit_w * self.target_s

    @property
    def above_idle_j(self) -> float:
        return (self.power_limit_w - self.idle_w) * self.target_s

    @property
    def gflop_per_j(self) -> float:
        """Useful GFLOP per joule (all of it, idle included) the target needs at the limit."""
        return self.flops / self.joules_at_limit / 1e9

    def share(self, above_idle: float) -> float:
        """A piece's energy above idle as a fraction of the target's budget above idle."""
        return above_idle / self.above_idle_j

    def tflops_at_cap(self, above_idle: float) -> float:
        """The TFLOP/s the board would reach at its limit if a launch cost this much above idle."""
        return self.flops / cap_time_s(above_idle, self.power_limit_w, self.idle_w) / 1e12
