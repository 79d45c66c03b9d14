"""Where a number was measured: the host a training epoch, an evaluation or an export ran on.

Float training is reproducible to the byte on one host, not across hosts: a CPU with other vector
units takes other kernels (``torch.backends.cpu.get_cpu_capability()``), a GPU other cuDNN kernels,
and a 2-core VM of one kind can be 3.7x slower than another. So every record whose numbers depend on
the machine (``metrics.jsonl``'s epochs, the model file, ``metrics.json``, ``export.json``) carries
:func:`describe`'s dictionary, and the report and the model card print :func:`summary` of it.

Read back from a file, the dictionary is untrusted: :func:`problems` checks its shape before
anything renders it.
"""
from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

# key -> the types a recorded host may hold there (None: not known on that host)
FIELDS: dict[str, tuple[type, ...]] = {
    "hostname": (str,), "cpu_model": (str,), "cpu_capability": (str,), "cores": (int,), "torch_threads": (int,),
    "gpu_count": (int,), "gpu_names": (list,), "torch": (str,), "cuda": (str, type(None)),
    "cudnn": (int, type(None)), "python": (str,), "machine": (str,),
}
OPTIONAL: dict[str, tuple[type, ...]] = {"backend": (str,), "world_size": (int,)}
_MAX_TEXT = 200


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``; elsewhere what :mod:`platform` says)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh.read(1 << 20).splitlines():
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()[:_MAX_TEXT]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "unknown")[:_MAX_TEXT]


def describe(*, backend: str | None = None, world_size: int | None = None) -> dict[str, Any]:
    """This process's host: CPU model and the vector ISA torch dispatches to, cores it may use and
    torch's threads, GPUs, the versions of torch, CUDA and cuDNN; the backend and world size of the
    run when given (a training's). Imports torch (the readers of a record do not need it)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out: dict[str, Any] = {
        "hostname": socket.gethostname()[:_MAX_TEXT],
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        "torch_threads": torch.get_num_threads(),
        "gpu_count": gpus,
        "gpu_names": sorted({torch.cuda.get_device_name(i) for i in range(gpus)}),
        "torch": str(torch.__version__),          # a str subclass torch.load(weights_only) refuses
        "cuda": torch.version.cuda,
        "cudnn": int(cudnn) if cudnn is not None and gpus else None,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if backend is not None:
        out["backend"] = backend
    if world_size is not None:
        out["world_size"] = int(world_size)
    return out


def problems(obj: Any) -> list[str]:
    """Why ``obj`` is not a host record as :func:`describe` writes it ([] when it is)."""
    if not isinstance(obj, dict):
        return [f"not a host record (a {type(obj).__name__})"]
    out = []
    for key, types in {**FIELDS, **OPTIONAL}.items():
        if key not in obj:
            if key in FIELDS:
                out.append(f"no {key!r}")
            continue
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, types):
            out.append(f"{key} is a {type(value).__name__}")
        elif isinstance(value, str) and len(value) > _MAX_TEXT:
            out.append(f"{key} is longer than {_MAX_TEXT} characters")
        elif isinstance(value, int) and not 0 <= value <= 1_000_000:
            out.append(f"{key} {value} is out of range")
        elif key == "gpu_names" and not all(isinstance(n, str) and len(n) <= _MAX_TEXT for n in value):
            out.append("gpu_names is not a list of names")
    unknown = sorted(set(obj) - set(FIELDS) - set(OPTIONAL))
    if unknown:
        out.append(f"unknown keys {unknown}")
    return out


def summary(host: dict[str, Any] | None) -> str:
    """One line for people: ``AMD EPYC 7B13 (AVX2), 2 cores, 2 threads; no GPU; torch 2.14.1; horovod, world 2``."""
    if not host:
        return "not recorded"
    gpus = host["gpu_count"]
    gpu = "no GPU" if not gpus else f"{gpus} x {', '.join(host['gpu_names'])}"
    versions = f"torch {host['torch']}"
    if gpus:
        versions += f" (CUDA {host['cuda']}, cuDNN {host['cudnn']})"
    text = (f"{host['cpu_model']} ({host['cpu_capability']}), {host['cores']} cores, {host['torch_threads']} threads; "
            f"{gpu}; {versions}")
    if "backend" in host:
        text += f"; {host['backend']}, world {host.get('world_size', '?')}"
    return f"{text}; host {host['hostname']}"
