"""Device tier (L0): the memory tier's fixed-size slots in one torch tensor on the model's device.

The layout, the free list and the accounting are the memory tier's (``storage/memory.py``);
only the slab differs: a ``torch.uint8`` tensor allocated once on ``device`` (``"cpu"``,
``"cuda"``, ``"cuda:1"``, ...). On the CPU the slab is shared with a numpy view, so a
read is the same zero-copy view the memory tier gives. On an accelerator a read copies
the frame to the host, where the codec verifies it; ``tensor(key)`` gives the frame's
bytes in place, on the device, for a consumer that reads KV there.

torch is imported only when a device tier is configured: the cache itself does not need it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from prefixcache.storage.base import Frame
from prefixcache.storage.memory import MemoryStore

__all__ = ["DeviceStore"]


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the test extra installs torch
        raise ValueError("a device tier needs torch (pip install torch)") from None
    return torch


class DeviceStore(MemoryStore):
    """Frames in fixed-size slots of one uint8 tensor on ``device``."""

    kind: ClassVar[str] = "device"

    def __init__(self, capacity_bytes: int, slot_bytes: int, device: str = "cpu") -> None:
        torch = _torch()
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"bad device {device!r}: {exc}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
        self._tensor: Any = None
        super().__init__(capacity_bytes, slot_bytes)

    def _allocate(self, nbytes: int) -> tuple[np.ndarray, memoryview]:
        torch = _torch()
        self._tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            slab: np.ndarray = self._tensor.numpy()  # shares the tensor's memory
            return slab, slab.data.toreadonly()
        empty = np.zeros(0, dtype=np.uint8)
        return empty, empty.data.toreadonly()

    def _write(self, start: int, view: memoryview) -> None:
        if self.device.type == "cpu":
            super()._write(start, view)
            return
        torch = _torch()
        host = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())
        self._tensor[start : start + view.nbytes].copy_(host)

    def _read(self, start: int, length: int) -> Frame:
        if self.device.type == "cpu":
            return super()._read(start, length)
        host: np.ndarray = self._tensor[start : start + length].cpu().numpy()
        return host.data.toreadonly()

    def tensor(self, key: bytes) -> Any:
        """The frame of ``key`` as a uint8 tensor view on the device (``None`` if absent)."""
        held = self._where.get(key)
        if held is None:
            return None
        slot, length = held
        start = slot * self.slot_bytes
        return self._tensor[start : start + length]

    def close(self) -> None:
        super().close()
        self._tensor = None
