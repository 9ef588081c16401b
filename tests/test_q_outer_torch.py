"""q-outer-torch, a backend added as one module: found by existing, its options and schedule declared,
its output the float64 reference's at every chunk size."""
import pytest

from msa_bench.harness.measure.check import check_backend, edge_case_workload, tolerance  # sets TRITON_INTERPRET first
from msa_bench.harness.store.rows import schedule_of
from msa_bench.kernels.base import get_backend, registered_names
from msa_bench.scenarios.workload import AttnShape

SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)


def test_it_is_registered_by_its_module_alone():
    assert "q-outer-torch" in registered_names()
    assert schedule_of("q-outer-torch@c4") == "q-outer" and get_backend("q-outer-torch@c4").chunk == 4
    with pytest.raises(KeyError, match="c1\\|c4\\|c16"):
        get_backend("q-outer-torch@c5")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "fp8", "bf16"])
@pytest.mark.parametrize("option", ["", "@c1", "@c4"])
def test_every_chunk_size_matches_the_reference(option, dtype):
    # 23 tokens: chunks of 4 and 16 leave a short last one; padding, a hot block, tokens that see nothing
    w = edge_case_workload(SHAPE, dtype, [200, 120], [13, 10], False, hot=0.5, pad=0.3, empty=2, seed=3)
    err, tol, details = check_backend(f"q-outer-torch{option}", w)
    assert err <= tol == tolerance(dtype) and details["stages"] == ["attention"]
