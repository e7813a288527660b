"""The torch.save envelope around each DCP item.

DCP stores every tensor as a tiny torch.save zip around the tensor's bytes. Saving builds it
without the zip CRC32 (`save_tensor`) and remembers each tensor form's envelope, so that a
load can find a tensor's bytes inside the stored file and read them straight into the
target (`direct_envelope`) instead of unpickling a copy. Built on torch's private
serialization API where it must be; every use falls back to plain torch.save/torch.load
when the private API is not there."""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.planner import (
    ReadItem,
)

from fusefs.client.reader import seek_position


def save_tensor(t: torch.Tensor, sink: Any) -> None:
    """torch.save(t, sink) without the zip CRC32 (the chunks carry their own checksums).

    torch computes a CRC32 of every record unless told not to, and the switch
    (`set_crc32_options`) is process-global. This builds the same zip writer torch.save does
    with the flag passed explicitly, so nothing global changes (async THREAD saves, other
    threads' torch.save are unaffected). Bytes and offsets equal torch.save's with CRC off.

    Without the CRC, everything torch.save writes around a plain tensor's bytes (the
    pickle, the zip headers and directory: ~1.5 KB in ~40 writes) depends only on the
    tensor's type, dtype, shape and strides. The first save of each such form is captured
    (`Envelope`); later ones write the captured bytes around the tensor's own. A 40-tensor
    rank spent ~16% of its step-2 CPU in torch's pickling and zip writer."""
    if NO_CRC_SAVE is None:
        torch.save(t, sink)
        return
    key = envelope_key(t)
    env = ENVELOPES.get(key) if key is not None else None
    if env is not None:
        sink.write(env.head)
        sink.write(tensor_bytes(t))
        sink.write(env.tail)
        return
    rec = Recorder(sink, t) if key is not None else sink
    writer = torch._C.PyTorchFileWriter(rec, False, NO_CRC_SAVE)
    torch.serialization._save(t, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    if key is not None:
        env = rec.envelope()
        if env is not None and len(ENVELOPES) < ENVELOPES_MAX:
            ENVELOPES[key] = env


class Envelope(NamedTuple):
    head: bytes  # what torch.save writes before the tensor's bytes
    tail: bytes  # and after them


ENVELOPES: dict[tuple, Envelope] = {}
ENVELOPES_MAX = 4096  # distinct tensor forms remembered per process


def envelope_key(t: torch.Tensor) -> tuple | None:
    """The form of a tensor whose torch.save bytes are an envelope around its own bytes,
    or None (a subclass, a grad-tracking or hooked tensor, Python attributes, tensor
    metadata, a view into a larger storage, conj/neg bits, nesting: saved by torch
    every time)."""
    if (
        type(t) is not torch.Tensor
        or t.requires_grad
        or t.layout is not torch.strided
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or t.storage_offset()
        or not t.nbytes
        or t.untyped_storage().nbytes() != t.nbytes
        or t.is_conj()
        or t.is_neg()
        or t.is_quantized
        or t.is_nested
        or t._backward_hooks
        or t.__dict__
        or torch._utils.get_tensor_metadata(t)
    ):
        return None
    return (t.dtype, tuple(t.shape), t.stride())


def address(mv: memoryview) -> int:
    """Where a buffer's bytes start in memory (read-only buffers too)."""
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Recorder:
    """A sink that forwards torch.save's writes and keeps them, to capture an envelope."""

    def __init__(self, sink: Any, t: torch.Tensor) -> None:
        self.sink = sink
        self.addr, self.n = t.untyped_storage().data_ptr(), t.nbytes
        self.parts: list[bytes | None] = []  # None: the tensor's own bytes

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if mv.nbytes == self.n and address(mv) == self.addr:
            self.parts.append(None)
        else:
            self.parts.append(bytes(mv))  # torch reuses its small buffers: copy now
        return self.sink.write(mv)

    def envelope(self) -> Envelope | None:
        """The writes around the tensor's storage (None if torch wrote it in pieces, or
        not at all: then nothing is cached)."""
        if self.parts.count(None) != 1:
            return None
        i = self.parts.index(None)
        return Envelope(b"".join(self.parts[:i]), b"".join(self.parts[i + 1 :]))  # type: ignore[arg-type]


def no_crc_alignment() -> int | None:
    """Storage alignment for save_tensor, or None if this torch's internals differ."""
    try:
        import inspect

        params = list(inspect.signature(torch.serialization._save).parameters)
        if params != [
            "obj",
            "zip_file",
            "pickle_module",
            "pickle_protocol",
            "_disable_byteorder_record",
        ]:
            return None
        return int(torch.serialization._get_storage_alignment())
    except (AttributeError, TypeError, ValueError):
        return None


NO_CRC_SAVE = no_crc_alignment()


def direct_envelope(req: ReadItem, target: torch.Tensor) -> Envelope | None:
    """The envelope torch.save (CRC off, as save_tensor) writes around a contiguous tensor
    of the target's dtype and shape, when the item is all of the stored tensor and the
    target can take its bytes as they are (any storage around it is left alone); else None."""
    if (
        NO_CRC_SAVE is None
        or type(target) is not torch.Tensor
        or target.device.type != "cpu"
        or target.layout is not torch.strided
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.is_quantized
        or not target.nbytes
        or any(req.storage_offsets)
        or tuple(req.lengths) != tuple(target.size())
    ):
        return None
    shape = tuple(target.size())
    stride, step = [], 1
    for n in reversed(shape):  # a fresh tensor's strides, as torch.empty makes them
        stride.append(step)
        step *= max(n, 1)
    key = (target.dtype, shape, tuple(reversed(stride)))
    env = ENVELOPES.get(key)
    if env is None and len(ENVELOPES) < ENVELOPES_MAX:
        try:  # its pages are never touched, but the address space is reserved
            form = torch.empty(shape, dtype=target.dtype)
        except (RuntimeError, MemoryError):
            return None
        if envelope_key(form) != key:
            return None
        save_tensor(form, NullSink())  # captures the envelope; the sink keeps nothing
        env = ENVELOPES.get(key)
    return env


def load_in_place(view: memoryview) -> torch.Tensor | None:
    """torch.load of a torch.save'd tensor whose storage *is* `view` (no copy): the item's
    one copy is then `target.copy_` straight from the mapped cache file, where torch.load
    would first copy every byte into a new storage. This is what torch.load(mmap=True) does
    for a file path, through the same loader (the weights-only unpickler, so the safety is
    the same); it is private API of the pinned torch, so any surprise falls back (None)."""
    try:
        from torch import _weights_only_unpickler
        from torch.serialization import _load, _open_zipfile_reader

        with _open_zipfile_reader(ViewReader(view)) as zf:
            storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
            out = _load(zf, "cpu", _weights_only_unpickler, overall_storage=storage)
    except (ImportError, AttributeError, TypeError, RuntimeError, ValueError):
        return None
    return out if isinstance(out, torch.Tensor) else None


class ViewReader(io.RawIOBase):
    """A seekable read-only file over bytes or a memoryview, without copying them first
    (io.BytesIO copies a memoryview; torch.load reads records with readinto)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.mv = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = seek_position(self.pos, len(self.mv), off, whence)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), len(self.mv) - self.pos))
        dst[:n] = self.mv[self.pos : self.pos + n]
        self.pos += n
        return n


class NullSink:
    def write(self, b: Any) -> int:
        return memoryview(b).nbytes
