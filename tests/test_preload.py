"""`r3srv serve` preloads tcmalloc where it applies (r3srv.preload): the decision on generated
environments, and a real server process, whose PID stays the one its parent started."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from r3srv import preload
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # real servers

LIBRARY = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("old", ["", "/opt/libother.so"])
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_preloads_the_library_ahead_of_the_callers(monkeypatch, tmp_path, old, device):
    monkeypatch.setattr(preload, "NVIDIA_CONTROL_DEVICE", str(tmp_path / "no-driver"))
    environ = {"HOME": "/root", **({"LD_PRELOAD": old} if old else {})}
    env = preload.preload_env(environ, device, True, LIBRARY)
    assert env == {"HOME": "/root", "LD_PRELOAD": f"{LIBRARY}:{old}" if old else LIBRARY}


@pytest.mark.parametrize("case", ["turned off", "not installed", "cuda", "auto with a driver", "already preloaded"])
def test_runs_as_is(monkeypatch, tmp_path, case):
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(preload, "NVIDIA_CONTROL_DEVICE", str(driver if case == "auto with a driver" else tmp_path / "none"))
    environ = {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"} if case == "already preloaded" else {}
    device = {"cuda": "cuda:1", "auto with a driver": "auto"}.get(case, "cpu")
    library = None if case == "not installed" else LIBRARY
    assert preload.preload_env(environ, device, case != "turned off", library) is None


def test_finds_the_first_installed_library(tmp_path):
    present = tmp_path / "libtcmalloc_minimal.so.4"
    present.touch()
    assert preload.tcmalloc_path([str(tmp_path / "absent.so"), str(present)]) == str(present)
    assert preload.tcmalloc_path([str(tmp_path / "absent.so")]) is None


def test_the_server_process_runs_with_tcmalloc_where_installed():
    """The PID its parent started maps tcmalloc after the re-exec when the library is installed
    (CI installs it: .ci/run), and runs on glibc's malloc otherwise; it serves either way."""
    installed = preload.tcmalloc_path() is not None
    with RemoteServer(*TEST_SERVER_ARGS) as srv:
        maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
        assert ("libtcmalloc" in maps) == installed, (installed, srv.log)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
