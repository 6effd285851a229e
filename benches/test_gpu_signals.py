"""benches/gpu_signals.py's CPU smoke (benches/gpu_check.sh runs it on the device): every row
measured, masks and selections checked on the way."""

import gpu_signals


def test_every_row_is_measured_on_the_cpu(tmp_path):
    out = tmp_path / "table.md"
    rows = gpu_signals.main(["--device", "cpu", "--rounds", "1", "--out", str(out)])
    assert len(rows) == len(gpu_signals.mask_bench.SHAPES) + 1
    assert all(off > 0 and on > 0 for _, off, on in rows)
    assert out.read_text().count("\n") == len(rows) + 2  # header, rule, a line a row
