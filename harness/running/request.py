"""A sweep request: the options as given, the grid they resolve to, and the command that resumes them.

`--shard i/n` takes every n-th point starting at i (0-based), so shards are disjoint, cover the grid
and each builds only its own workloads. Points that cannot fit in memory are refused here, before
anything is allocated.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ..store import results
from ...errors import UserError
from ..measure.timing import TimingConfig


@dataclass
class SweepRequest:
    scenario: str | None = None
    reuse: list[float] | None = None
    tokens: list[int] | None = None
    context: list[int] | None = None
    skew: list[float] | None = None
    dtypes: list[str] | None = None
    backends: list[str] | None = None
    causal: bool | None = None
    generator: str | None = None
    share: list[float] | None = None
    share_group: list[int] | None = None
    trace: str | None = None         # --trace FILE: the trace's calls as the grid (scenarios/trace.py)
    calls: str | None = None         # --calls: which of them
    out: str | None = None
    resume: bool = False
    shard: str | None = None
    counters: bool = False
    reps: int | None = None
    timer: str | None = None         # --timer graph|eager (harness/measure/timing.py); None: graph
    rounds: int | None = None        # --rounds: eager, a point's units in interleaved rounds; None: the scenario's
    gpus: str | None = None          # --gpus all|N|LIST: one worker process per GPU (harness/running/pool.py)
    device: str | None = None        # --device: the profile `auto` and the model rows use (roofline.devices)
    argv: list[str] = field(default_factory=list)

    def grid_options(self) -> dict:
        """What decides the grid (and nothing about where or how it runs): a worker resolves the same."""
        return dict(scenario=self.scenario, reuse=self.reuse, tokens=self.tokens, context=self.context,
                    skew=self.skew, dtypes=self.dtypes, backends=self.backends, causal=self.causal,
                    generator=self.generator, share=self.share, share_group=self.share_group, shard=self.shard,
                    reps=self.reps, trace=self.trace, calls=self.calls, timer=self.timer,
                    rounds=self.rounds)


@dataclass
class Grid:
    """What a request resolves to before any run folder exists."""
    scenario: object
    overrides: dict
    backends: list[str]
    shard: tuple[int, int] | None
    every: list          # (point, backend) of the whole grid
    mine: list           # (point, backend) this shard runs, in run order
    mine_ids: list[str]
    grid_sha: str
    timing: TimingConfig

    def units(self) -> dict:
        """unit id -> (point, backend), in run order."""
        return dict(zip(self.mine_ids, self.mine))


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise UserError(f"--shard i/n needs n >= 1 and 0 <= i < n, got {text!r}")
    return i, n


def resolve_scenario(req: SweepRequest, device, notes: list[str]):
    from ...scenarios.grid import load_scenario, with_overrides, with_trace
    name = req.scenario
    if name is None:
        name = "default" if device.type == "cuda" else "smoke"
        if device.type != "cuda":
            notes.append("no CUDA GPU here: the trace's calls on the `smoke` scenario's backends and timing (pass "
                         "--scenario or --backend to choose)" if req.trace is not None else
                         "no CUDA GPU here: running the small `smoke` scenario (pass --scenario to choose)")
    scenario = load_scenario(name)
    if req.calls is not None and req.trace is None:
        raise UserError("--calls needs --trace FILE")
    if req.trace is not None:
        scenario = with_trace(scenario, req.trace, req.calls)
    overrides = {k: v for k, v in dict(reuse=req.reuse, tokens=req.tokens, context=req.context, skew=req.skew,
                                       dtypes=req.dtypes, backends=req.backends, causal=req.causal,
                                       generator=req.generator, share=req.share,
                                       share_group=req.share_group).items() if v is not None}
    if overrides:
        scenario = with_overrides(scenario, **overrides)
    if req.trace is not None:           # recorded with the run: a resume must name the same trace and calls
        overrides.update(trace=scenario.grids[0]["trace"][0], calls=req.calls)
    return scenario, overrides


def validate_backends(names) -> list[str]:
    from ...kernels.base import get_backend
    names = list(dict.fromkeys(names))
    for name in names:
        try:
            get_backend(name)              # unknown names and bad @options raise KeyError with the reason
        except KeyError as exc:
            raise UserError(exc.args[0]) from None
    if not names:
        raise UserError("no backends to run: the scenario and --backend leave none")
    return names


def plan_units(points, backends, shard: tuple[int, int] | None):
    """All units of the grid and the ones this shard runs, in run order (points outer)."""
    every = [(p, b) for p in points for b in backends]
    mine_points = points if shard is None else points[shard[0]::shard[1]]
    mine = [(p, b) for p in mine_points for b in backends]
    return every, mine


def resolve(req: SweepRequest, device, notes: list[str]) -> Grid:
    shard = parse_shard(req.shard)
    scenario, overrides = resolve_scenario(req, device, notes)
    backends = validate_backends(scenario.backends)
    points = list(scenario.points)
    if not points:
        raise UserError(f"the grid of scenario {scenario.name!r} is empty after overrides; nothing to run")
    every, mine = plan_units(points, backends, shard)
    if not mine:
        raise UserError(f"shard {req.shard} of scenario {scenario.name!r} holds no points "
                        f"(the grid has {len(points)})")
    every_ids = [results.unit_id(p.key(), b) for p, b in every]
    if len(set(every_ids)) != len(every_ids):
        raise UserError(f"scenario {scenario.name!r} has duplicate points (same key twice)")
    timing = TimingConfig.from_dict(getattr(scenario, "timing", None), reps=req.reps, timer=req.timer,
                                    rounds=req.rounds)
    return Grid(scenario, overrides, backends, shard, every, mine,
                [results.unit_id(p.key(), b) for p, b in mine], results.grid_digest(every_ids), timing)


def check_memory(grid: Grid, device, notes: list[str]) -> None:
    """Refuse, before anything is allocated, a grid none of whose points' workloads and partials fit on
    `device`. When some do, the others stay in the grid: their units are recorded unavailable (a scenario
    sized for a larger GPU still runs on a smaller one), and a note says how many."""
    from ...scenarios.grid import check_point_fits
    unfit, seen = [], set()
    for p, _ in grid.mine:
        if p.key() not in seen:
            seen.add(p.key())
            try:
                check_point_fits(p, device)
            except UserError as exc:
                unfit.append(str(exc))
    if unfit and len(unfit) == len(seen):
        raise UserError(unfit[0])
    if unfit:
        notes.append(f"{len(unfit)} of {len(seen)} points do not fit in this device's free memory; their units "
                     f"are recorded unavailable (first: {unfit[0]})")


def resume_command(req: SweepRequest, scenario_name: str, run_dir) -> str:
    """The exact command that continues this sweep: the same grid options, --out and --resume."""
    def listed(values):
        return ",".join(str(v) for v in values)
    args = ["msa-bench", "sweep", "--scenario", req.scenario or scenario_name]
    for option, values in (("--reuse", req.reuse), ("--tokens", req.tokens), ("--context", req.context),
                           ("--skew", req.skew), ("--dtype", req.dtypes), ("--backend", req.backends),
                           ("--share", req.share), ("--share-group", req.share_group)):
        if values is not None:
            args += [option, listed(values)]
    if req.causal is not None:
        args.append("--causal" if req.causal else "--no-causal")
    if req.generator is not None:
        args += ["--generator", req.generator]
    if req.trace is not None:
        args += ["--trace", req.trace] + ([f"--calls={req.calls}"] if req.calls is not None else [])
    if req.shard is not None:
        args += ["--shard", req.shard]
    if req.counters:
        args.append("--counters")
    if req.reps is not None:
        args += ["--reps", str(req.reps)]
    if req.timer is not None:
        args += ["--timer", req.timer]
    if req.rounds is not None:
        args += ["--rounds", str(req.rounds)]
    if req.gpus is not None:
        args += ["--gpus", req.gpus]
    return shlex.join(args + ["--out", str(run_dir), "--resume"])
