"""The one counter of what a GPU would be asked to do, run on CPU: kernel launches (non-view aten
calls), host syncs, by name, and the bytes that copies write (device memory traffic that computes
nothing: `COPYING` ops, the bytes of what each writes). bench/gpu_proxy.py prints its figures and tests/cosyvoice2 assert
them (test_lm_syncs: one sync per LM step).

On CUDA the host waits for the device at
- every Python-level read of a device value: `item()`, `int()`, `float()`, `bool()`, `__index__`,
  `tolist()`, `cpu()`, `numpy()`;
- every op whose output size depends on values: `nonzero`, boolean-mask indexing (read or
  written), `masked_select`, `repeat_interleave` without an output size, `unique`;
- every blocking copy between host and device: `torch.tensor(..., device=)` /
  `torch.as_tensor(..., device=)` and a host tensor's `.to(<a device or a tensor>)` without
  non_blocking (a pageable host-to-device copy: torch waits for the stream after it), and copies
  from a device tensor to the CPU.

The aten ops are seen through a TorchDispatchMode. The Python-level reads are not all seen there
(under inference_mode a CPU tensor's `int()` and `item()` never reach the mode: a counter that
watched only aten saw 1 sync per LM step on 77c2663, whose per-row `int(ids[...])` made 5 at one
row and 20 at 16), so they and the tensor factories are patched while a count runs. On CPU the
Python-level reads and `.to(device)` copies are counted whatever the devices: an upper bound (a
list read from a CPU-only tensor costs nothing on a GPU, nor does `.to(device)` of a tensor that
would already be there; on CPU every device is the host, so a copy's destination cannot tell).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

READS = ("tolist", "cpu", "numpy", "item", "__int__", "__float__", "__bool__", "__index__")
FACTORIES = ("tensor", "as_tensor")  # with a device: a blocking host-to-device copy
VALUE_SIZED = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
               aten.masked_select.default, aten._unique2.default,
               aten.unique_consecutive.default, aten.unique_dim.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
# ops that only move data, and which argument holds what they write (None: their output)
COPYING = {aten._to_copy.default: None, aten.clone.default: None, aten.cat.default: None, aten.stack.default: None,
           aten.index_select.default: None, aten.gather.default: None, aten.index.Tensor: None,
           aten.copy_.default: 1, aten.index_copy_.default: 3, aten.index_put_.default: 2,
           aten._index_put_impl_.default: 2}


class DeviceWork(TorchDispatchMode):
    """While active: `calls`, the non-view aten calls (kernel launches on a GPU), `syncs`, the
    calls that make the host wait for the device, by name, and `copied`, the bytes copies wrote
    (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.copied = 0
        self.syncs: collections.Counter[str] = collections.Counter()
        self._reading = 0  # inside a counted Python-level read: its own aten calls are not syncs again
        self._patches: contextlib.ExitStack | None = None

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        for method in READS:
            self._patch(torch.Tensor, method, self._read(f"Tensor.{method}", getattr(torch.Tensor, method)))
        self._patch(torch.Tensor, "to", self._copy_to("Tensor.to(device) from the host", torch.Tensor.to))
        for factory in FACTORIES:
            self._patch(torch, factory, self._construct(f"torch.{factory}(..., device=)", getattr(torch, factory)))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _patch(self, owner, name: str, replacement) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        self._patches.callback(setattr, owner, name, original)

    def _read(self, name: str, original):
        def read(*args, **kwargs):
            if not self._reading:
                self.syncs[name] += 1
            self._reading += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._reading -= 1
        return read

    def _copy_to(self, name: str, original):
        def to(tensor, *args, **kwargs):
            names_device = kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str, torch.Tensor)) for a in args)
            if (not self._reading and names_device and tensor.device.type == "cpu"
                    and not kwargs.get("non_blocking", False) and True not in args[1:]):
                self.syncs[name] += 1
            return original(tensor, *args, **kwargs)
        return to

    def _construct(self, name: str, original):
        def construct(*args, **kwargs):
            if kwargs.get("device") is not None:
                self.syncs[name] += 1
            return original(*args, **kwargs)
        return construct

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            self.calls += 1
        if not self._reading:
            sync = _sync_name(func, args, kwargs)
            if sync is not None:
                self.syncs[sync] += 1
        out = func(*args, **kwargs)
        if func in COPYING:
            written = out if COPYING[func] is None else args[COPYING[func]]
            self.copied += written.numel() * out.element_size()
        return out


def _sync_name(func, args, kwargs) -> str | None:
    if func in VALUE_SIZED:
        return str(func)
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and kwargs.get("output_size") is None:
        return f"{func} (no output_size)"
    if func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                for i in args[1] if i is not None):
        return f"{func} (boolean mask)"  # its kernel counts the True entries on the host first
    if func in COPIES:
        src = args[1] if func is aten.copy_.default else args[0]
        if func is aten.copy_.default:
            to_cpu = args[0].device.type == "cpu"
        else:
            to_cpu = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and to_cpu:
            return f"{func} (to the host)"
    return None
