"""`r3srv serve` preloads tcmalloc where it applies and has torch's OpenMP threads wait
passively on the CPU (r3srv.preload): the decisions on generated environments, and real server
processes, whose PID stays the one their parent started and whose libgomp reports the policy."""

from __future__ import annotations

import random
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


@pytest.mark.parametrize("seed", range(6))
def test_openmp_waits_passively_beside_a_pool_of_kernels_unless_the_user_chose(monkeypatch, tmp_path, seed):
    """Generated environments: the passive wait is added for a CPU server whose kernels run on a
    pool of their own only, and never over a wait policy or spin count already in the
    environment, whatever its value."""
    rng = random.Random(seed)
    driver = tmp_path / "nvidiactl"
    driver.touch()
    for _ in range(40):
        has_driver = rng.random() < 0.5
        monkeypatch.setattr(preload, "NVIDIA_CONTROL_DEVICE", str(driver if has_driver else tmp_path / "none"))
        device = rng.choice(["cpu", "auto", "cuda", "cuda:1"])
        on_team = rng.random() < 0.5
        environ = {"HOME": "/root"}
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
            if rng.random() < 0.4:
                environ[name] = rng.choice(["ACTIVE", "passive", "0", "10000", ""])
        on_gpu = device.startswith("cuda") or (device == "auto" and has_driver)
        chosen = "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ
        want = {} if on_gpu or chosen or on_team else {"OMP_WAIT_POLICY": "PASSIVE"}
        assert preload.openmp_env(environ, device, on_team) == want, (device, has_driver, on_team, environ)


@pytest.mark.parametrize(("user_policy", "kernels_on_team", "shown"), [
    (None, True, ("OMP_WAIT_POLICY = 'PASSIVE'", "GOMP_SPINCOUNT = '300000'")),  # libgomp's default
    (None, False, ("OMP_WAIT_POLICY = 'PASSIVE'", "GOMP_SPINCOUNT = '0'")),
    ("ACTIVE", False, ("OMP_WAIT_POLICY = 'ACTIVE'",)),
])
def test_the_server_process_has_libgomp_wait_as_chosen(monkeypatch, user_policy, kernels_on_team, shown):
    """libgomp prints the wait it loaded with (OMP_DISPLAY_ENV): its default spin (it prints
    PASSIVE for the unset policy, and spins 300,000 times) where the kernels run on torch's team,
    no spinning beside a pool of their own, and the user's own policy where one is set. torch
    loads libgomp after serve sets the policy."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the server's own choice, not this shell's
        monkeypatch.delenv(name, raising=False)
    env = {"OMP_DISPLAY_ENV": "VERBOSE", "R3SRV_OPENMP_KERNEL_THREADS": "1" if kernels_on_team else "0",
           **({"OMP_WAIT_POLICY": user_policy} if user_policy else {})}
    with RemoteServer(*TEST_SERVER_ARGS, env=env) as srv:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        log = srv.log
    assert "OPENMP DISPLAY ENVIRONMENT BEGIN" in log, log[-3000:]
    assert all(line in log for line in shown), log[-3000:]
    if user_policy is not None:
        assert "GOMP_SPINCOUNT = '0'" not in log, log[-3000:]


@pytest.mark.parametrize("seed", range(4))
def test_waits_passively_reads_what_libgomp_reads(seed):
    """A passive policy (any case) or a spin count of 0 is a passive wait; anything else spins."""
    rng = random.Random(seed)
    for _ in range(60):
        policy = rng.choice([None, "PASSIVE", "passive", " Passive ", "ACTIVE", "active", ""])
        spins = rng.choice([None, "0", " 0", "1", "300000", ""])
        environ = {k: v for k, v in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spins)) if v is not None}
        want = (policy or "").strip().lower() == "passive" or (spins or "").strip() == "0"
        assert preload.waits_passively(environ) == want, environ
