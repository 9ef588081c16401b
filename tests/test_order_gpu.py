"""benchmarks/order_gpu.py without a GPU: how orders are written and the configs they make."""
from __future__ import annotations

import sys
from pathlib import Path

from msa_bench.harness import check  # noqa: F401  (sets TRITON_INTERPRET first on a CPU)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import order_gpu  # noqa: E402


def test_orders_parse_chunks_and_phases():
    assert order_gpu.parse_orders("1:0,2:8,1:p,4") == [(1, 0), (2, 8), (1, "p"), (4, 0)]
    assert [order_gpu.order_label(o) for o in order_gpu.parse_orders("2:p,4:8")] == ["2:p", "4:8"]


def test_orders_make_the_scheduler_configs():
    phased = order_gpu.backend_for("triton", "fp8", (2, "p")).config
    assert phased.q_ranges == 2 and phased.order_phases and phased.order_chunk == 0
    dealt = order_gpu.backend_for("v23", "fp8", (4, 8)).config
    assert dealt.q_ranges == 4 and dealt.order_chunk == 8 and not dealt.order_phases
