"""Every registered backend keeps the contract it declares: its schedule, stages, options and dtypes, a
plan that runs the declared stages into an output of the workload's shape, the float64 check (and its
own stage checks) on a small workload, one line for what it cannot run or parse.

Backends that run on the CPU (Triton's interpreter, PyTorch) are checked here; the others are marked
`cuda` and checked on a GPU."""
import inspect

import pytest
import torch

from msa_bench.harness.measure.check import compare_output, edge_case_workload, poison  # sets TRITON_INTERPRET first
from msa_bench.roofline.predict import MODELLED
from msa_bench.kernels.base import Backend, Plan, backend_class, get_backend, registered_names
from msa_bench.kernels.options import Choice, Number, Rest, parse_options
from msa_bench.roofline.dtypes import DType
from msa_bench.roofline.schedules import Schedule
from msa_bench.scenarios.workload import AttnShape

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# the interpreter is slow: a small shape on the CPU; on a GPU the study's tile geometry (G 16, D 128, block 128)
SHAPE = AttnShape(hq=32, hkv=2, head_dim=128, block=128, topk=4) if CUDA else \
    AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
DTYPE_ORDER = ("bf16", "fp8", "fp16", "fp32") if CUDA else ("fp32", "fp16", "fp8", "bf16")
NAMES = registered_names()


def runs_on_cpu(name: str) -> bool:
    backend = get_backend(name)
    return any(backend.unavailable_reason(d, "cpu") is None for d in backend.dtypes)


ON_DEVICE = [n if runs_on_cpu(n) else pytest.param(n, marks=[pytest.mark.cuda, pytest.mark.skipif(
    not CUDA, reason=f"{n} runs only on a CUDA GPU")]) for n in NAMES]


def small_workload(dtype: str):
    """Two causal requests with padded selections and a hot block: every query token sees a key."""
    kv_lens = [12 * SHAPE.block + 5, 7 * SHAPE.block + 9]
    return edge_case_workload(SHAPE, dtype, kv_lens, [9, 7], causal=True, hot=0.3, pad=0.3, seed=1, device=DEVICE)


@pytest.mark.parametrize("name", NAMES)
def test_the_class_declares_schedule_stages_dtypes_and_options(name):
    cls = backend_class(name)
    assert issubclass(cls, Backend) and cls.name == name and cls.description and "\n" not in cls.description
    assert cls.schedule is None or isinstance(cls.schedule, Schedule)
    if cls.candidate:                        # `auto` weighs it: the model must know its schedule
        assert cls.schedule in MODELLED
    assert all(isinstance(s, str) for s in cls.stage_names) and len(set(cls.stage_names)) == len(cls.stage_names)
    assert set(get_backend(name).dtypes) <= set(DType) and get_backend(name).dtypes
    keywords = inspect.signature(cls.__init__).parameters
    for key, option in cls.options.items():
        assert key in keywords, f"{name}: option {key!r} is no constructor keyword"
        assert isinstance(option, (Choice, Number, Rest)) and option.examples()
    assert sum(o.rest for o in cls.options.values()) <= 1


@pytest.mark.parametrize("name", NAMES)
def test_every_option_word_names_a_backend_and_a_bad_one_is_one_line(name, cli, one_error_line):
    options = backend_class(name).options
    for key, option in options.items():
        for word in option.examples():
            assert key in parse_options(name, options, word)
    if options:                              # a word of every option at once builds the backend
        text = "+".join(o.examples()[0] for o in options.values())
        assert set(parse_options(name, options, text)) == set(options)
        assert get_backend(f"{name}@{text}").name == f"{name}@{text}"
    with pytest.raises(KeyError) as exc:
        get_backend(f"{name}@zz9")
    message = exc.value.args[0]
    assert "\n" not in message and (f"{name} " in message or f"backend {name!r}" in message), message
    code, _, err = cli("check", "--backend", f"{name}@zz9", "--dtype", "fp32")
    assert code == 2 and one_error_line(err) == f"error: {message}"


@pytest.mark.parametrize("name", NAMES)
def test_unavailable_reason_is_none_or_one_line(name):
    backend = get_backend(name)
    for device in ("cpu", "cuda") if CUDA else ("cpu",):
        for dtype in DType:
            reason = backend.unavailable_reason(dtype, device)
            assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason), reason
            if dtype not in backend.dtypes:
                assert reason, f"{name} claims {dtype} it does not list"


@pytest.mark.parametrize("name", ON_DEVICE)
def test_plan_runs_its_stages_and_passes_the_float64_check(name):
    backend = get_backend(name)
    dtype = next(d for d in DTYPE_ORDER if d in backend.dtypes and backend.unavailable_reason(d, DEVICE) is None)
    w = small_workload(dtype)
    reason = backend.workload_unavailable_reason(w)
    if reason and CUDA:              # e.g. a CuTe library not built here, or a selection dense-gather cannot take
        pytest.skip(reason)
    assert reason is None
    plan = backend.plan(w)
    assert isinstance(plan, Plan) and plan.stages and plan.plan_seconds > 0
    if backend.stage_names:
        assert tuple(plan.stages) == backend.stage_names
    out_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert plan.output.shape == (w.n_tokens, SHAPE.hq, SHAPE.head_dim) and plan.output.dtype == out_dtype
    assert plan.lse is None or (plan.lse.shape == (w.n_tokens, SHAPE.hq) and plan.lse.dtype == torch.float32)
    poison(plan)
    plan.run()
    err, tol, _ = compare_output(plan, w)
    assert err <= tol, f"{name} {dtype}: max rel err {err:.3g} over {tol:g}"
    rows = torch.arange(w.n_tokens, device=w.device)
    for stage, (ok, message) in backend.stage_checks(plan, w, rows, tol).items():
        assert ok and "\n" not in message, f"{name} {stage}: {message}"
