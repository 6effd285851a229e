"""r3srv/settings.py: every R3SRV_* variable read once into one typed object, shown as serve flags,
and no environment read anywhere else in the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_fixture import serve_command

from r3srv import settings
from r3srv.cli import build_parser
from r3srv.errors import ConfigError
from r3srv.settings import ENV_NAMES, Settings

PACKAGE = Path(settings.__file__).parent

# variable -> (text, the field's value)
EXAMPLES = {
    "R3SRV_CPU_THREADS": ("3", 3),
    "R3SRV_CACHE_DIR": ("/tmp/r3srv-cache", Path("/tmp/r3srv-cache")),
    "R3SRV_ENCODE_THREADS": ("2", 2),
    "R3SRV_HUGEPAGES": ("0", False),
    "R3SRV_TCMALLOC": ("0", False),
    "R3SRV_BASE64_ISA": ("portable", "portable"),
    "R3SRV_TRITON_DECODE": ("0", False),
    "R3SRV_RUST_DECODE": ("0", False),
    "R3SRV_RUST_PREFILL": ("0", False),
    "R3SRV_VARLEN_PREFILL": ("1", True),
    "R3SRV_FUSED_STEP": ("0", False),
    "R3SRV_GROUPED_MM": ("0", False),
    "R3SRV_CPU_EXPERT_KERNEL": ("0", False),
    "R3SRV_PACKED_EXPERTS": ("0", False),
    "R3SRV_PACKED_LINEAR": ("0", False),
    "R3SRV_AMX_TILES": ("0", False),
    "R3SRV_RUST_RMS_NORM": ("0", False),
    "R3SRV_RUST_LINEAR": ("0", False),
    "R3SRV_RUST_ROPE": ("0", False),
    "R3SRV_RUST_ROUTER": ("0", False),
    "R3SRV_FAST_CPU_DECODE": ("0", False),
    "R3SRV_OPENMP_KERNEL_THREADS": ("0", False),
    "R3SRV_FORCE_TORCH_ROUTER": ("1", True),
    "R3SRV_EP_DISPATCH": ("all_to_all", "all_to_all"),
    "R3SRV_CUDA_GRAPHS": ("1", True),
}


def test_every_variable_is_one_field():
    assert sorted(ENV_NAMES.values()) == sorted(EXAMPLES)
    defaults = Settings.from_environ({})
    assert defaults == Settings()
    for name, (text, value) in EXAMPLES.items():
        field = next(f for f, env in ENV_NAMES.items() if env == name)
        got = Settings.from_environ({name: text})
        assert getattr(got, field) == value != getattr(defaults, field), name
        assert got == defaults.replace(**{field: value})  # that variable changes that field only
    assert Settings.from_environ({"R3SRV_FORCE_TORCH_ROUTER": "true"}).force_torch_router  # as before
    assert Settings.from_environ({"R3SRV_GROUPED_MM": ""}).grouped_mm  # empty: the default


@pytest.mark.parametrize("name,text", [("R3SRV_CPU_THREADS", "zero"), ("R3SRV_CPU_THREADS", "0"),
                                       ("R3SRV_ENCODE_THREADS", "-1"), ("R3SRV_BASE64_ISA", "sse9"),
                                       ("R3SRV_EP_DISPATCH", "alltoall")])
def test_bad_values_are_config_errors_naming_the_variable(name, text):
    with pytest.raises(ConfigError, match=name):
        Settings.from_environ({name: text})


def test_serve_flags_default_to_the_environment():
    parser = build_parser()
    environ = {"R3SRV_CPU_THREADS": "4", "R3SRV_GROUPED_MM": "0"}
    from_env = settings.from_args(parser.parse_args(["serve"]), environ)
    assert from_env == Settings(cpu_threads=4, grouped_mm=False)
    flags = ["serve", "--cpu-threads", "2", "--grouped-mm", "--no-triton-decode", "--cache-dir", "/x", "--base64-isa", "avx2"]
    given = settings.from_args(parser.parse_args(flags), environ)
    assert given == Settings(cpu_threads=2, grouped_mm=True, triton_decode=False, cache_dir=Path("/x"), base64_isa="avx2")
    with pytest.raises(ConfigError, match="--cpu-threads"):
        settings.from_args(parser.parse_args(["serve", "--cpu-threads", "two"]), {})


def test_serve_help_shows_every_setting_and_a_bad_one_exits_before_start_up():
    out = subprocess.run(serve_command("--help"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for field, env in ENV_NAMES.items():
        assert "--" + field.replace("_", "-") in out.stdout and env in out.stdout
    out = subprocess.run(serve_command("--cpu-threads", "0"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cpu_threads" in out.stderr and "positive integer" in out.stderr


def test_no_environment_reads_outside_the_settings_module():
    readers = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        # preload.py hands the process's environment on to exec with LD_PRELOAD set and sets
        # libgomp's wait policy for torch to read: no setting
        if path.name not in ("settings.py", "preload.py") and ("os.environ" in text or "getenv" in text):
            readers.append(path.relative_to(PACKAGE))
    assert readers == []
    rust = Path(__file__).parents[1] / "rust" / "src"
    assert [p.name for p in rust.glob("*.rs") if "env::var" in p.read_text(encoding="utf-8")] == []


def test_settings_are_read_once(r3srv_settings, monkeypatch):
    from r3srv.ops import ops_for
    from r3srv.ops.experts import SILU_AND_MUL, grouped_mm_available

    def torch_pass():  # the CPU backend's torch expert pass, its kernels chosen now
        return ops_for("cpu", torch.float32).experts(SILU_AND_MUL).fallback

    r3srv_settings(grouped_mm=True)
    rows, w2 = torch.zeros(64, 8), torch.zeros(64, 8, 4)  # a row per expert: grouped when on
    if not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    built = torch_pass()
    assert built.uses_grouped_mm(rows, w2)
    monkeypatch.setenv("R3SRV_GROUPED_MM", "0")  # too late: read at start-up
    assert torch_pass().uses_grouped_mm(rows, w2)
    r3srv_settings(grouped_mm=False)
    assert not torch_pass().uses_grouped_mm(rows, w2)
    assert built.uses_grouped_mm(rows, w2)  # what a model built before holds does not change


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512vbmi"])
def test_the_encoder_takes_its_kernel_from_the_settings(isa):
    """A process started with R3SRV_BASE64_ISA=isa encodes with it when the CPU has it (and says
    which it uses), bytes equal to the reference either way."""
    code = (
        "import numpy as np; from r3srv.serial import encoder_isa, encode_routed_experts, numpy2base64;"
        "a = np.random.default_rng(0).integers(0, 256, (3000, 48, 8), dtype=np.uint8);"
        "assert encode_routed_experts(a, 5) == numpy2base64(a[5:]); print(encoder_isa())"
    )
    env = dict(os.environ, R3SRV_BASE64_ISA=isa)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    used = out.stdout.strip()
    fastest = subprocess.run([sys.executable, "-c", "from r3srv.serial import encoder_isa; print(encoder_isa())"],
                             capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "R3SRV_BASE64_ISA"}).stdout.strip()
    order = ["avx512vbmi", "avx2", "portable"]
    assert used == (isa if order.index(isa) >= order.index(fastest) else fastest)


def test_fleet_replicas_get_the_settings_flags():
    """`--data-parallel-size N` starts replicas with the supervisor's flags: settings included."""
    from r3srv.data_parallel import replica_argv

    parser = build_parser()
    args = parser.parse_args(["serve", "--cpu-threads", "2", "--no-grouped-mm", "--base64-isa", "portable"])
    argv = replica_argv(parser, args, model=None, port=1234, device="cpu", weight_version="0")
    replica = settings.from_args(parser.parse_args(argv[argv.index("serve"):]), {})
    assert replica == Settings(cpu_threads=2, grouped_mm=False, base64_isa="portable")
