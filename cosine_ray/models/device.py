"""Where the model runs: the ``device`` and ``dtype`` settings, checked once and early.

``device`` is ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``; ``dtype`` is
``float32``, ``bfloat16`` or ``float16`` (the half types pay on CUDA; on CPU they run, but
slowly unless the CPU has bf16/fp16 matrix instructions). Two checks, kept apart on purpose:

- ``check_device_name`` / ``check_dtype_name``: the spelling, anywhere (a config file read
  on a laptop may name ``cuda`` for the cluster it is deployed to);
- ``device_unavailable``: whether *this process* can use the device (CUDA built in, a GPU
  visible, the index in range). The CLI asks it where the model will run in this process
  (``generate``, ``bench``, ``profile``, ``serve`` on a local cluster), so asking for CUDA
  where there is none is one line and exit 2, not a traceback from deep in a forward.

Importing this module does not import torch (``engine.config`` checks names with it).
"""

from __future__ import annotations

import re

DTYPES = ("float32", "bfloat16", "float16")
RUNNER_MODES = ("auto", "eager", "graph", "static")
"""How a stage runs its steps (``models.runner``; ``RuntimeConfig.runner``)."""
_DEVICE = re.compile(r"^(cpu|cuda(:(0|[1-9][0-9]*))?)$")


def check_device_name(device: object) -> str:
    """``device`` if it is ``cpu``, ``cuda`` or ``cuda:N``; ValueError otherwise."""
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"device {device!r}: use cpu, cuda or cuda:N")
    return device


def check_dtype_name(dtype: object) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use {', '.join(DTYPES)}")
    return str(dtype)


def device_unavailable(device: str) -> str | None:
    """Why this process cannot run on ``device`` (one line), or None when it can."""
    check_device_name(device)
    if device == "cpu":
        return None
    import torch
    if not torch.backends.cuda.is_built():
        return (f"device {device!r}: this PyTorch ({torch.__version__}) is built without CUDA; "
                f"install a CUDA build of torch, or use --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        return f"device {device!r}: no CUDA GPU is visible to this process; use --device cpu"
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"device {device!r}: only {count} CUDA GPU(s) are visible (cuda:0..cuda:{count - 1})"
    return None


def require_device(device: str) -> None:
    """ValueError (one line) when this process cannot run on ``device``."""
    reason = device_unavailable(device)
    if reason is not None:
        raise ValueError(reason)


def synchronize(device: object) -> None:
    """Wait for ``device``'s queued work (CUDA kernels run asynchronously): call before
    reading a clock around GPU work. Nothing to wait for on CPU."""
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)


def indices_to(values, device):
    """int64 indices (a list, or nested lists) on ``device`` without a host sync: on CUDA through
    pinned memory and a non-blocking copy (a pageable copy would wait for every kernel queued
    before it)."""
    import torch
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
