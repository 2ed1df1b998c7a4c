"""The device a command runs on, from its `--device` flag; waiting for a device's queued work."""

from __future__ import annotations

from quantspec.errors import QuantSpecError

__all__ = ["AUTO", "device_done", "device_memory_budget", "resolve_device"]

AUTO = "auto"
_KINDS = ("cpu", "cuda")


def resolve_device(name: str, flag: str = "--device") -> str:
    """`name` as a torch device string: "auto" is CUDA when there is one, else the CPU.

    Refuses, in one line naming `flag`, a device torch does not know, a kind quantspec does not run
    on, and CUDA (or a CUDA index) this machine does not have.
    """
    import torch

    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise QuantSpecError(f"{flag} {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in _KINDS:
        raise QuantSpecError(f"{flag} {name!r}: quantspec runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantSpecError(f"{flag} {name}: CUDA is not available on this machine; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QuantSpecError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def device_done(device) -> None:
    """Return once the work queued on `device` has run: a CUDA call returns as soon as its kernels
    are queued, so a timing of it ends here. Nothing to wait for on the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory_budget(device, utilization: float) -> int | None:
    """Bytes a CUDA device can still give this process so that no more than `utilization` of its
    memory is in use (by anyone: the weights already loaded, other processes), less a headroom
    for a step's activations and the libraries' workspaces (1 GiB, or 4% of the device where that
    is more); None on the CPU, whose memory is the system's."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    headroom = max(2**30, int(0.04 * total))
    return int(utilization * total) - (total - free) - headroom
