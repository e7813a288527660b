"""CkptfsFileSystem: the fsspec AbstractFileSystem over a ckptfs volume.

Where Python's data and training libraries already are: torch DCP picks its fsspec writer
for any URL fsspec knows, Lightning writes checkpoints to fsspec URLs, pandas and pyarrow
read and write through it. This is a thin frontend over the volume client every other
frontend uses (fusefs.client): namespace calls by path, file data through FileWriter and
FileReader (files.py), and nothing of its own on the data path.

What the volume makes cheap is used rather than emulated: `cp_file` is a metadata-only
copy (one commit of the source's extents: the chunks are shared), `mv` is one rename of a
whole tree, `checksum` comes from the content ids of the extents, and `cat_file` with a
range fetches only the chunks the range covers.

One volume per process and target (fusefs.client.registry), opened when the filesystem is
made, so a wrong host, token or volume fails right there with ConnectionError,
PermissionError or FileNotFoundError; by default with the host's write-behind tier, as the
mount and the DCP backend use it (storage option staging=False writes straight to the
object nodes); staged chunks drain at process exit.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import time
from datetime import UTC, datetime
from typing import Any

import xxhash
from fsspec.spec import AbstractFileSystem
from fsspec.utils import stringify_path

from fusefs.client.extents import clip
from fusefs.client.reader import FileReader
from fusefs.client.registry import tier_spec, volume_for
from fusefs.client.volume import Volume
from fusefs.fsspec.errors import translated
from fusefs.fsspec.files import CkptfsFile
from fusefs.fsspec.urls import PROTOCOL, Target, strip_url, truthy, url_options
from metadata.engine import Attr, MetaError


class CkptfsFileSystem(AbstractFileSystem):
    """fsspec filesystem for `ckptfs://HOST:PORT/PATH` (a service), `ckptfs:///PATH` (the
    embedded default volume, or the directory named by `volume=`).

    Storage options: host, port, volume, token_file, tls, ca, retry (as in service URLs;
    the token from token_file=, CKPTFS_TOKEN_FILE or CKPTFS_TOKEN, never token=: fsspec
    keeps its options); staging (True: the default per-volume staging directory; a path;
    False: no write-behind tier), durability ("local" or "remote"), staging_size (bytes)."""

    protocol = (PROTOCOL,)
    root_marker = "/"
    sep = "/"

    def __init__(
        self,
        host: str | None = None,
        port: int | str | None = None,
        *,
        volume: str | os.PathLike | None = None,
        token: str | None = None,
        token_file: str | None = None,
        tls: bool | str = False,
        ca: str | None = None,
        retry: float | str | None = None,
        staging: str | os.PathLike | bool | None = True,
        durability: str = "local",
        staging_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if token is not None:
            # fsspec keeps every storage option (fs.to_json(), pickle): a secret passed here
            # would travel with them
            raise ValueError(
                "ckptfs: fsspec keeps its storage options (to_json, pickle), so it takes no "
                "token=: give token_file=PATH, or set CKPTFS_TOKEN_FILE or CKPTFS_TOKEN"
            )
        super().__init__(**kwargs)
        self.target = Target(
            host=host or None,
            port=int(port) if port not in (None, "") else None,
            volume=os.fspath(volume) if volume is not None else None,
            token_file=token_file,
            tls=truthy(tls),
            ca=ca,
            retry=float(retry) if retry is not None else None,
        )
        spec = self.target.spec()
        where = spec.split("?", 1)[0] if spec else "the embedded default volume"
        with translated(where):
            if spec is None:
                from fusefs.client.defaults import ensure_default_volume

                spec = ensure_default_volume()
            self._opened = (spec, tier_spec(staging, durability, staging_size))
            self.blocksize = self.volume.settings.chunk_size

    @property
    def volume(self) -> Volume:
        """The process's volume for this target, from the registry on every use: fsspec
        keeps filesystem instances across calls, and one made before `close_volumes()` (a
        test's teardown, a fork) reopens its volume instead of holding a closed one."""
        spec, tier = self._opened
        return volume_for(spec, tier)

    # -- paths -----------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]  # type: ignore[return-value]
        return strip_url(stringify_path(path))

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict:
        return url_options(stringify_path(path))

    def unstrip_protocol(self, name: str) -> str:
        return self.target.prefix + self._strip_protocol(name)

    def _url(self, path: str) -> str:
        return self.unstrip_protocol(path)

    def _resolve(self, path: str) -> Attr:
        with translated(self._url(path)):
            return self.volume.resolve(path)

    def info_of(self, path: str, attr: Attr) -> dict:
        """fsspec's info dict of a volume entry."""
        kind = "directory" if attr.is_dir else "file" if attr.is_reg else "other"
        info = {
            "name": path,
            "size": attr.size if not attr.is_dir else 0,
            "type": kind,
            "mode": attr.mode,
            "ino": attr.ino,
            "nlink": attr.nlink,
            "uid": attr.uid,
            "gid": attr.gid,
            "mtime": attr.mtime_ns / 1e9,
            "ctime": attr.ctime_ns / 1e9,
            "islink": attr.is_link,
        }
        return info

    # -- listing ---------------------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        path = self._strip_protocol(path)
        attr = self._resolve(path)
        if not attr.is_dir:
            out = [self.info_of(path, attr)]
        else:
            with translated(self._url(path)):
                entries = self.volume.listdir(path)
            base = path.rstrip("/")
            out = [self.info_of(f"{base}/{os.fsdecode(name)}", a) for name, a in entries]
        out.sort(key=lambda i: i["name"])
        return out if detail else [i["name"] for i in out]

    def info(self, path: str, **kwargs: Any) -> dict:
        path = self._strip_protocol(path)
        return self.info_of(path, self._resolve(path))

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=UTC)

    def created(self, path: str) -> datetime:
        """The inode's change time, as fsspec's local filesystem reports st_ctime."""
        return datetime.fromtimestamp(self.info(path)["ctime"], tz=UTC)

    def checksum(self, path: str) -> int:
        """A file's checksum from its content ids: the same bytes cut the same way (and
        every copy made by cp_file) give the same value, with no byte read."""
        path = self._strip_protocol(path)
        attr = self._resolve(path)
        if not attr.is_reg:
            return super().checksum(path)
        with translated(self._url(path)):
            extents = clip(self.volume.meta.get_extents(attr.ino), attr.size)
        h = xxhash.xxh3_64(struct.pack("<Q", attr.size))
        for e in extents:
            h.update(struct.pack("<QQQ", e.offset, e.length, e.chunk_off))
            h.update(e.chunk_id)
        return h.intdigest()

    def ukey(self, path: str) -> str:
        return f"{self.checksum(path):016x}"

    # -- directories -----------------------------------------------------------------------
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if path == "/" or self.exists(path):
            raise FileExistsError(errno.EEXIST, f"File exists: {self._url(path)}")
        with translated(self._url(path)):
            self.volume.mkdir(path, parents=create_parents)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = self._strip_protocol(path)
        if path == "/":
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, f"File exists: {self._url(path)}")
            return
        try:
            attr = self.volume.resolve(path)
        except MetaError:
            attr = None
        if attr is not None:
            if not attr.is_dir:
                raise FileExistsError(errno.EEXIST, f"File exists (not a directory): {path}")
            if not exist_ok:
                raise FileExistsError(errno.EEXIST, f"File exists: {self._url(path)}")
            return
        with translated(self._url(path)):
            self.volume.mkdir(path, parents=True)

    def rmdir(self, path: str) -> None:
        path = self._strip_protocol(path)
        if not self._resolve(path).is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {self._url(path)}")
        with translated(self._url(path)):
            self.volume.unlink(path)

    # -- removing, copying, moving ---------------------------------------------------------
    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        if self._resolve(path).is_dir:
            raise IsADirectoryError(errno.EISDIR, f"Is a directory: {self._url(path)}")
        with translated(self._url(path)):
            self.volume.unlink(path)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Files, and with recursive=True whole trees (deepest entries first)."""
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in sorted(paths, key=lambda p: p.count("/"), reverse=True):
            if p == "/":
                continue
            try:
                attr = self.volume.resolve(p)
            except MetaError as e:
                if e.errno == errno.ENOENT:
                    continue  # a glob's match removed with its directory
                raise
            if attr.is_dir and not recursive:
                raise IsADirectoryError(
                    errno.EISDIR, f"Is a directory: {self._url(p)} (rm with recursive=True)"
                )
            with translated(self._url(p)):
                self.volume.unlink(p)
        self.invalidate_cache()

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """A metadata-only copy: the destination commits the source's extents, so both name
        the same chunks (nothing is read or stored). A directory is made, not filled."""
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        attr = self._resolve(src)
        if attr.is_dir:
            self.makedirs(dst, exist_ok=True)
            return
        if not attr.is_reg:
            raise OSError(errno.EINVAL, f"not a regular file: {self._url(src)}")
        with translated(self._url(dst)):
            extents = clip(self.volume.meta.get_extents(attr.ino), attr.size)
            target = self.volume.create_file(dst, parents=True)
            if target.ino != attr.ino:
                self.volume.meta.commit_file(target.ino, extents, attr.size, [])

    def mv(
        self,
        path1: Any,
        path2: Any,
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        """One rename (a whole tree moves in one transaction); into path2 when it is an
        existing directory. Globs and lists go the generic way (copy, then remove)."""
        if not (isinstance(path1, str) and isinstance(path2, str)) or any(
            c in path1 for c in "*?["
        ):
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if src == dst:
            return
        attr = self._resolve(src)
        if attr.is_dir and not recursive:
            raise IsADirectoryError(
                errno.EISDIR, f"Is a directory: {self._url(src)} (mv with recursive=True)"
            )
        try:
            into = self.volume.resolve(dst).is_dir
        except MetaError:
            into = False
        if into or str(path2).endswith("/"):
            dst = dst.rstrip("/") + "/" + src.rsplit("/", 1)[-1]
        with translated(f"{self._url(src)} -> {self._url(dst)}"):
            if self._parent(dst) != "/":
                self.volume.mkdir(self._parent(dst), parents=True)
            self.volume.rename(src, dst)
        self.invalidate_cache()

    # -- data -----------------------------------------------------------------------------
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> CkptfsFile:
        return CkptfsFile(
            self,
            self._strip_protocol(path),
            mode=mode,
            block_size=block_size,
            autocommit=autocommit,
            cache_options=cache_options,
            **kwargs,
        )

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """Bytes [start, end) of a file (negative: from its end): only those chunks are
        fetched."""
        path = self._strip_protocol(path)
        attr = self._resolve(path)
        if not attr.is_reg:
            err = errno.EISDIR if attr.is_dir else errno.EINVAL
            raise OSError(err, f"{os.strerror(err)}: {self._url(path)}")
        with translated(self._url(path)):
            with FileReader(self.volume, attr, readahead=0) as r:
                size = r.size
                lo = 0 if start is None else (max(0, size + start) if start < 0 else start)
                hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
                return r.pread(lo, max(0, hi - lo))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """A whole file in one write; mode="create" refuses an existing path."""
        with self.open(path, "xb" if mode == "create" else "wb", **kwargs) as f:
            f.write(value)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if truncate or not self.exists(path):
            self.pipe_file(path, b"")
            return
        attr = self._resolve(path)
        with translated(self._url(path)):
            self.volume.meta.setattr(attr.ino, mtime_ns=time.time_ns())

    def islink(self, path: str) -> bool:
        try:
            return stat.S_ISLNK(self.info(path)["mode"])
        except FileNotFoundError:
            return False
