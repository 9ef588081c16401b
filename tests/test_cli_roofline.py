import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from msa_bench.cli import app

runner = CliRunner()


def test_roofline_json_has_crossover():
    res = runner.invoke(app, ["roofline", "--device", "b200", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert 2.65 <= data["crossover_nsb_per_n"] <= 3.05
    assert set(data["per_query_token_bytes"]) == {"q-outer", "kv-outer", "msa-scatter"}


def test_roofline_table_names_binding_resources():
    res = runner.invoke(app, ["roofline", "--device", "h200", "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert "Predicted crossover" in res.output and "hbm" in res.output


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu9"], "unknown device"),
    (["--hq", "63"], "multiple of --hkv"),
    (["--block", "-4"], "must be positive"),
    (["--dtype", "int4"], "--dtype"),
    (["--device", "/nonexistent/profile.json"], "does not exist"),
])
def test_roofline_bad_input_is_one_line_and_nonzero(args, message):
    # through the real console entry point: one line on stderr, exit 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "msa_bench.cli", "roofline", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("device", ["b200", "h200"])
def test_roofline_tables_fit_80_columns_with_whole_numbers(device):
    """Every byte figure of the table is printed whole and no line is wider than 80 columns."""
    import io

    from rich.console import Console

    from msa_bench.roofline.devices import load_device
    from msa_bench.roofline.model import ModelShape
    from msa_bench.roofline.render import print_roofline
    from msa_bench.roofline.summary import roofline_summary
    summary = roofline_summary(ModelShape(hq=64, hkv=4, head_dim=128, block=128, topk=16, dtype="fp8"),
                               load_device(device))
    buf = io.StringIO()
    print_roofline(summary, Console(file=buf, width=80, color_system=None))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text, text
    for levels in summary["per_query_token_bytes"].values():
        for terms in levels.values():
            assert f"{sum(terms.values()):,.0f}" in text
