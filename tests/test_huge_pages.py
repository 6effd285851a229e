"""The model's weights on the CPU in transparent huge pages (r3srv/huge_pages.py,
rust/src/huge_pages.rs): advised before the loader writes them, never changing a value, off
with settings.huge_pages."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from r3srv import huge_pages
from r3srv.models.loader import load_model

HUGE = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage")


def thp_mode(name: str = "enabled") -> str:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/`name` ('' where absent)."""
    path = THP / name
    text = path.read_text() if path.is_file() else ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def needs_thp(at_fault: bool = False):
    """Skips, saying why, where advised memory gets no huge pages (or, at_fault, none when it
    first faults in: the kernel defers them to its background thread)."""
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are off here ({THP}/enabled: {thp_mode() or 'absent'})")
    if at_fault and thp_mode("defrag") not in ("always", "madvise", "defer+madvise"):
        pytest.skip(f"advised pages come as huge pages only later here ({THP}/defrag: {thp_mode('defrag') or 'absent'})")


def whole_pages(tensor: torch.Tensor) -> int:
    """Bytes of whole 2 MiB pages inside the tensor's storage, counted independently of the Rust core."""
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // HUGE) * HUGE
    end = (storage.data_ptr() + storage.nbytes()) // HUGE * HUGE
    return max(0, end - start)


def huge_bytes_at(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_this_build_has_the_entry():
    assert huge_pages.advise_entry is not None, "r3srv._core predates advise_huge_pages: rebuild the extension"


def weights(model) -> list[torch.Tensor]:
    return list(itertools.chain(model.parameters(), model.buffers()))


def test_the_loader_advises_every_weight_and_the_values_are_the_same(r3srv_settings):
    needs_thp(at_fault=True)
    r3srv_settings(huge_pages=False)
    plain, _ = load_model(None, dtype="float32")
    r3srv_settings(huge_pages=True)
    advised, _ = load_model(None, dtype="float32")
    # the advice changes how the pages are backed, never a value
    for (name, a), (_, b) in zip(plain.state_dict().items(), advised.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # marking again counts what the Rust core marks: every whole 2 MiB page of each distinct storage
    distinct = {t.untyped_storage().data_ptr(): t for t in weights(advised)}.values()
    assert huge_pages.advise(weights(advised)) == sum(whole_pages(t) for t in distinct) > 0


# A fresh process loads the built-in model (as `r3srv serve` does) and prints the huge-page
# bytes of the mapping that holds its largest weight (the stacked experts) where whole huge
# pages lie inside it. A process that has already freed much memory may reuse pages it touched
# before, which the advice leaves small: hence a process of its own.
LARGEST_WEIGHT_PAGES = """
import itertools, sys
sys.path.insert(0, {tests!r})
import test_huge_pages as t
from r3srv import settings
from r3srv.models.loader import load_model
with settings.overridden(huge_pages={on}):
    model, _ = load_model(None, dtype="float32")
largest = max(itertools.chain(model.parameters(), model.buffers()), key=lambda w: w.untyped_storage().nbytes())
assert t.whole_pages(largest) > 0
print(t.huge_bytes_at(-(-largest.untyped_storage().data_ptr() // t.HUGE) * t.HUGE))
"""


def largest_weight_huge_bytes(on: bool) -> int:
    script = LARGEST_WEIGHT_PAGES.format(tests=str(Path(__file__).parent), on=on)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_fresh_process_loads_its_weights_into_huge_pages():
    needs_thp(at_fault=True)
    assert largest_weight_huge_bytes(on=True) > 0, "the loader's writes did not fault in huge pages"
    if thp_mode() == "madvise":  # without the advice the same weights stay in small pages
        assert largest_weight_huge_bytes(on=False) == 0


def test_each_storage_counts_once_and_small_or_foreign_memory_is_left_alone(r3srv_settings):
    needs_thp()
    r3srv_settings(huge_pages=True)
    torch.manual_seed(0)
    big = torch.empty(5 * HUGE // 4)  # 10 MiB of float32: whole huge pages inside
    view = big[1000:]
    small = torch.empty(1000)
    marked = huge_pages.advise([big, view, small, torch.empty(0), torch.empty(4, device="meta")])
    assert marked == whole_pages(big) >= HUGE
    values = torch.randn(big.shape)
    big.copy_(values)  # written after the advice: the values are what was written
    assert torch.equal(big, values)


def test_the_setting_off_or_no_core_marks_nothing(r3srv_settings, monkeypatch):
    big = torch.empty(2 * HUGE)
    r3srv_settings(huge_pages=False)
    assert huge_pages.advise([big]) == 0
    r3srv_settings(huge_pages=True)
    monkeypatch.setattr(huge_pages, "advise_entry", None)
    assert huge_pages.advise([big]) == 0
