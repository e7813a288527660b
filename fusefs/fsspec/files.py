"""The file object of the ckptfs fsspec filesystem: FileReader and FileWriter underneath.

Reads are range reads (FileReader.pread: only the chunks a range covers are fetched, with
read-ahead of the following ones), so fsspec's own block cache is off by default
(cache_type="none"): a second cache would only add a copy. Writes go straight to a
FileWriter (the volume's chunker and its one chunk sink: dedup, compression policy, the
write-behind tier) without fsspec's write buffer, and become visible at close, in one
commit: a reader sees the old content or the new one, never a mix. A `with` block that
raises leaves the old content (or no file) behind, as a failed save should. The file is
created at that commit, so a file being written is not listed yet.

Append ("ab") keeps the existing content's extents as they are (its chunks are shared,
nothing is read back) and writes the new bytes after them. Transactions
(`fs.transaction`, autocommit=False) store at close and commit at the transaction's end.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from fsspec.spec import AbstractBufferedFile

from fusefs.client.extents import clip
from fusefs.client.reader import FileReader
from fusefs.client.writer import FileWriter
from fusefs.fsspec.errors import translated
from metadata.engine import MetaError

if TYPE_CHECKING:
    from fusefs.fsspec.filesystem import CkptfsFileSystem


class CkptfsFile(AbstractBufferedFile):
    """One open file: "rb" over a FileReader, "wb"/"xb"/"ab" over a FileWriter."""

    def __init__(
        self,
        fs: CkptfsFileSystem,
        path: str,
        mode: str = "rb",
        block_size: int | str | None = "default",
        autocommit: bool = True,
        cache_type: str = "none",
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> None:
        vol = fs.volume
        url = fs.unstrip_protocol(path)
        self._reader: FileReader | None = None
        self._writer: FileWriter | None = None
        self._stored = False  # closed with autocommit=False: stored, commit pending
        size = None
        if mode == "rb":
            with translated(url):
                self._reader = vol.open_read(path)
            size = self._reader.size
        elif mode in ("wb", "xb", "ab"):
            with translated(url):
                base = self._existing(fs, path, mode)
                self._writer = FileWriter(vol, 0)  # its inode is made at the commit
                if base is not None:
                    self._writer.append_to(*base)
        else:
            raise ValueError(f"mode {mode!r} not supported: use rb, wb, xb or ab")
        super().__init__(
            fs,
            path,
            mode=mode,
            block_size=block_size if block_size not in (None, "default") else fs.blocksize,
            autocommit=autocommit,
            cache_type=cache_type,
            cache_options=cache_options,
            size=size,
            **kwargs,
        )
        if self._reader is not None:
            self._details = fs.info_of(path, self._reader.attr)
        elif self._writer is not None:
            self.loc = self._writer.size

    @staticmethod
    def _existing(fs: CkptfsFileSystem, path: str, mode: str) -> tuple[list, int] | None:
        """Check the target before any byte is stored: a directory or, for "xb", an existing
        file fails now. For "ab", the existing content to append to."""
        vol = fs.volume
        try:
            attr = vol.resolve(path)
        except MetaError as e:
            if e.errno in (errno.ENOENT,):
                return None
            raise
        if attr.is_dir:
            raise MetaError(errno.EISDIR, "is a directory")
        if mode == "xb":
            raise MetaError(errno.EEXIST, "exists already (mode xb)")
        if mode == "ab" and attr.is_reg and attr.size:
            return clip(vol.meta.get_extents(attr.ino), attr.size), attr.size
        return None

    # -- reading ---------------------------------------------------------------------------
    def _fetch_range(self, start: int, end: int) -> bytes:
        assert self._reader is not None
        with translated(self.full_name):
            return self._reader.pread(start, end - start)

    # -- writing ---------------------------------------------------------------------------
    def write(self, data: Any) -> int:
        """Hand the bytes to the FileWriter now (its chunker copies them, so the caller may
        reuse its buffer); nothing is buffered here."""
        if not self.writable():
            raise ValueError("write to a closed file" if self.closed else "File not in write mode")
        assert self._writer is not None
        n = memoryview(data).nbytes
        with translated(self.full_name):
            self._writer.write(data)
        self.loc += n
        return n

    def flush(self, force: bool = False) -> None:
        """Nothing to push: written bytes are already in the writer. Durability and
        visibility come at close (fsspec files have no fsync)."""
        if self.closed:
            raise ValueError("Flush on closed file")

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._reader is not None:
                self._reader.close()
            elif self._writer is not None:
                with translated(self.full_name):
                    try:
                        self._writer.close(commit=False)  # stored and synced, not visible
                    except BaseException:
                        self._writer.abort()
                        raise
                    if self.autocommit:
                        self._publish()
                    else:
                        self._stored = True
        finally:
            self.closed = True
            if self.fs is not None and self._writer is not None:
                self.fs.invalidate_cache(self.path)
                self.fs.invalidate_cache(self.fs._parent(self.path))

    def _publish(self) -> None:
        """Create the file (and its parents) if needed and commit its content: one
        transaction over the extents (their chunks are stored and synced already)."""
        assert self._writer is not None
        attr = self.fs.volume.create_file(self.path, parents=True, exclusive=self.mode == "xb")
        self._writer.ino = attr.ino
        self._writer.commit()

    def commit(self) -> None:
        """The end of a transaction: make the stored content visible."""
        if self._stored:
            self._stored = False
            with translated(self.full_name):
                self._publish()

    def discard(self) -> None:
        """A transaction rolled back: the content is never committed (gc reclaims chunks
        that nothing else references)."""
        self._stored = False
        if self._writer is not None:
            self._writer.abort()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self._writer is not None and not self.closed:
            self.closed = True
            self._writer.abort()  # a failed write leaves the previous content
            return
        self.close()
