"""scripts/qpacked-ab.py's variant grammar: constructor flags joined by '+', each a library of its own."""
import pytest

from msa_bench.kernels.cute.manifest import QPackedConfig


@pytest.fixture
def ab(load_script):
    return load_script("qpacked-ab")


def test_variants_name_the_kernels_flags(ab):
    assert ab.parse_variant("default", "bf16") is None
    assert ab.parse_variant("plain", "bf16") == QPackedConfig("bf16")
    assert ab.parse_variant("pp+sa", "fp8") == QPackedConfig("fp8", True, True)
    assert ab.parse_variant("sa+kv4", "fp8") == QPackedConfig("fp8", False, True, kv_stages=4)
    assert ab.parse_variant("pairs", "fp8") == QPackedConfig("fp8", pairs=True)


def test_an_unknown_tag_is_one_line_and_a_failure(ab):
    with pytest.raises(SystemExit) as exc:
        ab.parse_variant("sa+q1", "bf16")
    assert "unknown variant tag 'q1'" in str(exc.value) and "\n" not in str(exc.value)
