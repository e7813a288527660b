"""FileWriter: a stream of bytes becomes a file, atomically, at close.

The volume's chunker cuts the bytes (fixed size or FastCDC; `cut()` forces a boundary, as
DCP does at every tensor); the chunks go through the volume's one chunk sink (ids,
existence, store, sync: fusefs.client.sink). Nothing is visible until close(), which
syncs what was stored and commits the extents and new chunks in one `commit_file`
transaction. Memory stays bounded by the chunker (one chunk) plus the sink's in-flight
window, whatever the file size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusefs.client.sink import ChunkStream
from metadata.engine import Attr, Extent, NewChunk

if TYPE_CHECKING:
    from fusefs.client.volume import Volume


class FileWriter:
    """Streams bytes into chunks; the file changes only at close(), in one commit."""

    def __init__(
        self, vol: Volume, ino: int, *, codec_name: str | None = None, inline: bool = True
    ) -> None:
        """inline=False: the file is committed through a checkpoint (commit_rank), which
        takes no inline chunks (ChunkSink.store). `codec_name` applies where chunks are
        encoded at write time (no local write-behind tier)."""
        self.vol = vol
        self.ino = ino
        self.hint = (codec_name, None)
        self.chunker = vol.make_chunker()
        self.stream: ChunkStream = vol.sink.stream(inline=inline)
        self.attr: Attr | None = None
        self.closed = False

    @property
    def size(self) -> int:
        return self.stream.size

    @property
    def extents(self) -> list[Extent]:
        return self.stream.extents

    @property
    def new_chunks(self) -> dict[bytes, NewChunk]:
        return self.stream.new_chunks

    def append_to(self, extents: list[Extent], size: int) -> None:
        """Start after an existing content (append): its extents are kept as they are (their
        chunks shared, nothing read back), and the bytes written next go at `size`. Call
        before the first write."""
        if self.stream.size or self.stream.extents:
            raise ValueError("append_to after a write")
        self.stream.extents = list(extents)
        self.stream.size = size

    def write(self, data: bytes | memoryview) -> int:
        if self.closed:
            raise ValueError("write to a closed FileWriter")
        self.stream.add_chunks(self.chunker.feed(data), self.hint)
        return len(data)

    def cut(self) -> None:
        """Force a chunk boundary here (DCP cuts at every tensor, for dedup)."""
        self.stream.add_chunks(self.chunker.cut(), self.hint)

    def flush_data(self) -> None:
        """Store every byte written so far durably (no commit)."""
        self.cut()
        self.stream.finish()
        self.vol.sink.sync()

    def close(self, *, commit: bool = True) -> Attr | None:
        if self.closed:
            return self.attr
        self.closed = True
        try:
            self.stream.add_chunks(self.chunker.finish(), self.hint)
            self.stream.finish()
            self.vol.sink.sync()
        except BaseException:
            self.stream.abort()
            raise
        if commit:
            self.commit()
        return self.attr

    def commit(self) -> Attr:
        """Publish what close(commit=False) stored: the file's new content, in one
        transaction (fsspec transactions commit files this way, after all are written)."""
        self.attr = self.vol.meta.commit_file(
            self.ino, self.extents, self.size, list(self.new_chunks.values())
        )
        return self.attr

    def abort(self) -> None:
        self.closed = True
        self.stream.abort()

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
