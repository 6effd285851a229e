"""Process settings: every R3SRV_* environment variable, read once, in one typed object.

`current()` reads the environment on first use (or `r3srv serve` calls `configure` at start-up
with its flags, whose defaults are these variables); code on hot paths reads an attribute of
the returned frozen object, never the environment. The Rust encoder's three settings are read
here too and handed to the Rust core once (`r3srv.serial` applies them on import).

`r3srv serve --help` shows each as a flag whose default is its variable. Backend switches are
for measuring and for ruling a kernel out; a user normally sets only the first three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import argparse

from r3srv.errors import ConfigError

BASE64_ISAS = ("auto", "avx512vbmi", "avx2", "portable")
EP_DISPATCHES = ("all_reduce", "all_to_all")


def _setting(default, help: str, flag: bool = True):
    """flag=False: the setting's serve flag is defined elsewhere (it also sets an engine field)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class Settings:
    # CPU forwards' threads: the Rust kernels' for every step, torch's for prefills only
    # (ops/cpu.py says why). Every setting below is read when a model is built (r3srv.ops.ops_for).
    cpu_threads: int = _setting(1, "threads of CPU forwards (torch's for prefill steps, the Rust kernels' always)")
    cache_dir: Path = _setting(Path.home() / ".cache" / "r3srv", "where the built-in checkpoint is generated")
    encode_threads: int = _setting(1, "Rust encoder threads for payloads of 4 MiB and more, at most the CPUs")
    huge_pages: bool = _setting(True, "transparent huge pages for encoder outputs of 32 MiB and more and for the model's weights on the CPU")
    base64_isa: str = _setting("auto", "base64 kernel: auto (the fastest this CPU has) or a slower one to measure")
    tcmalloc: bool = _setting(True, "serve re-executes itself with tcmalloc preloaded where installed (not for GPUs)")
    # Backend switches, to measure or to rule a kernel out:
    triton_decode: bool = _setting(True, "CUDA decodes through the paged-attention Triton kernel; off: gather + SDPA")
    rust_decode: bool = _setting(True, "CPU decodes through the Rust paged-attention kernel; off: gather + SDPA")
    rust_prefill: bool = _setting(True, "CPU prefill attention of a step's prompts in one Rust call (on more threads, large steps only); off: SDPA per prompt")
    varlen_prefill: bool = _setting(False, "CUDA prefill attention of a step's whole prompts in one varlen flash-attention "
                                    "call (not yet run on a GPU: off by default); off: SDPA per prompt")
    fused_step: bool = _setting(True, "CUDA decode steps of recurrent layers through fused Triton steps")
    grouped_mm: bool = _setting(True, "expert matmuls through torch's grouped_mm where it pays; off: a loop")
    cpu_expert_kernel: bool = _setting(True, "CPU expert pass in one Rust call per layer at every batch size; off: torch's paths")
    packed_experts: bool = _setting(True, "CPU experts also kept packed (twice their memory), which the expert pass "
                                    "reads: float32 ones in row tiles on an AVX-512 CPU, bfloat16 ones in panels where "
                                    "the AVX-512 BF16 dot products run (not AMX tiles); off: their rows read in place")
    amx_tiles: bool = _setting(True, "CPU bfloat16 experts' prefill products and prefill attention in AMX tiles "
                               "where the CPU has them; off: AVX-512 BF16 dot products (attention: torch's SDPA "
                               "where torch has AMX)")
    rust_rms_norm: bool = _setting(True, "CPU float32 RMSNorm in one Rust call; off: torch's rms_norm")
    rust_linear: bool = _setting(True, "CPU linear layers of up to 32 rows (63 of a float32 weight, 64 of a packed "
                                 "bfloat16 one) in one Rust call; off: torch's F.linear")
    packed_linear: bool = _setting(True, "CPU bfloat16 linear layers' weights also kept packed (twice their memory), "
                                   "which the Rust linear kernel reads where the packed bfloat16 experts' products "
                                   "run; off: their rows read in place")
    rust_rope: bool = _setting(True, "CPU q/k norms and RoPE of an attention layer in one Rust call; off: torch's ops")
    rust_router: bool = _setting(True, "CPU routing in one Rust call; off: the torch reference")
    fast_cpu_decode: bool = _setting(True, "CPU decode steps of plain MoE layers as straight kernel calls; off: the modules")
    openmp_kernel_threads: bool = _setting(True, "the Rust CPU kernels run on torch's OpenMP threads (one team with torch's "
                                           "ops) where torch runs GNU OpenMP; off: their own thread pool")
    force_torch_router: bool = _setting(False, "route with the torch reference, never the Triton kernel")
    ep_dispatch: str = _setting("all_reduce", "expert parallelism's combine: all_reduce or all_to_all (dispatch)")
    # Decode steps replayed as CUDA graphs when EngineConfig.cuda_graphs is not given (serve's own
    # --cuda-graphs flag sets that field).
    cuda_graphs: bool = _setting(False, "replay decode steps as CUDA graphs", flag=False)

    def __post_init__(self) -> None:
        for name in ("cpu_threads", "encode_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{_names(name)} must be a positive integer, got {value!r}")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ConfigError(f"{_names('ep_dispatch')} must be one of {', '.join(EP_DISPATCHES)}, got {self.ep_dispatch!r}")
        if self.base64_isa not in BASE64_ISAS:
            raise ConfigError(f"{_names('base64_isa')} must be one of {', '.join(BASE64_ISAS)}, got {self.base64_isa!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings the R3SRV_* variables in `environ` ask for (defaults for the others)."""
        values: dict = {}
        for f in dataclasses.fields(cls):
            text = environ.get(ENV_NAMES[f.name], "")
            if text != "":
                values[f.name] = _parse(f.name, text)
        return cls(**values)

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


ENV_NAMES = {f.name: "R3SRV_" + f.name.upper() for f in dataclasses.fields(Settings)}
ENV_NAMES["huge_pages"] = "R3SRV_HUGEPAGES"  # the names users already set


def _names(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')}, ${ENV_NAMES[name]})"


def _parse(name: str, text: str):
    default = _default(name)
    if isinstance(default, bool):
        # A switch that defaults on is turned off by "0"; one that defaults off is turned on by
        # anything but "0" (R3SRV_FORCE_TORCH_ROUTER=1 or =true), as before these settings.
        return text != "0"
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{_names(name)} must be a positive integer, got {text!r}") from None
    if isinstance(default, Path):
        return Path(text)
    return text


def _default(name: str):
    return Settings.__dataclass_fields__[name].default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, e.g. --cpu-threads, whose default is its environment variable."""
    group = parser.add_argument_group("settings", "each defaults to its R3SRV_* environment variable, else the value shown")
    for f in dataclasses.fields(Settings):
        if not f.metadata["flag"]:
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        helptext = f"{f.metadata['help']} (${ENV_NAMES[f.name]}, else {shown})"
        if isinstance(default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        elif f.name in ("base64_isa", "ep_dispatch"):
            choices = BASE64_ISAS if f.name == "base64_isa" else EP_DISPATCHES
            group.add_argument(flag, dest=f.name, choices=choices, default=None, help=helptext)
        else:
            group.add_argument(flag, dest=f.name, type=str, default=None, metavar=f.name.upper(), help=helptext)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """The environment's settings with the flags `add_arguments` defined that were given."""
    given = {}
    for f in dataclasses.fields(Settings):
        value = getattr(args, f.name, None) if f.metadata["flag"] else None
        if value is not None:
            given[f.name] = value if isinstance(value, bool) else _parse(f.name, value)
    return Settings.from_environ(environ).replace(**given)


# Secrets are not Settings fields: a Settings object may be printed or logged. `r3srv serve`'s
# --api-key and --admin-api-key default to these (several keys: comma-separated), and a fleet
# hands its keys to its replicas through them rather than on their command lines.
SECRET_ENV_NAMES = {"api_key": "R3SRV_API_KEY", "admin_api_key": "R3SRV_ADMIN_API_KEY"}


def secret_keys(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys of $R3SRV_API_KEY (name "api_key") or $R3SRV_ADMIN_API_KEY ("admin_api_key"), in
    `environ` (default: this process's)."""
    text = (os.environ if environ is None else environ).get(SECRET_ENV_NAMES[name], "")
    return [key.strip() for key in text.split(",") if key.strip()]


def child_environ(variables: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process: this process's, with `variables` set (a fleet's
    replicas get their keys so, not on their command lines)."""
    return {**os.environ, **variables}


def launcher_rank() -> int:
    """The RANK a launcher gave this process (torchrun's, or Ray's workers' as verl starts them); 0
    when started alone."""
    return int(os.environ.get("RANK", "0"))


def restrict_cuda_devices(devices: str) -> None:
    """Make only `devices` visible to CUDA in this process (before CUDA initializes)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = devices


_current: Settings | None = None


def current() -> Settings:
    """This process's settings, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Settings.from_environ()
    return _current


def configure(settings: Settings) -> Settings:
    """Make `settings` this process's settings (start-up, before any model is built; tests
    through their `r3srv_settings` fixture); returns the ones they replace."""
    global _current
    previous = current()
    _current = settings
    return previous


@contextlib.contextmanager
def overridden(**fields) -> Iterator[Settings]:
    """These fields changed for a with block, then the settings before it (benchmarks and tests
    comparing a backend switch on and off in one process)."""
    previous = configure(current().replace(**fields))
    try:
        yield current()
    finally:
        configure(previous)
