"""Volume errors as the exceptions fsspec users expect.

fsspec code (and torch DCP, Lightning, pandas above it) catches FileNotFoundError,
FileExistsError, PermissionError, ConnectionError and friends, never MetaError. An OSError
built from an errno is already the right subclass (OSError(ENOENT, ...) is a
FileNotFoundError), so one translation covers every call: the errno the engine chose,
the path or URL the user gave, and the engine's own words.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from chunkstore.nodes import NodeError
from chunkstore.store import ChunkStoreError
from fusefs.client.volume import VolumeError
from metadata.engine import MetaError

# Connection-level errnos of the service client: ConnectionError subclasses.
_CONNECTION = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT}


def as_os_error(err: int, what: str, detail: str) -> OSError:
    """An OSError of the subclass Python maps `err` to, naming `what` and why."""
    if err in _CONNECTION or err == errno.EACCES:
        return OSError(err, detail)  # the client's message already names the service
    _, found, rest = detail.partition(": not found")
    if err == errno.ENOENT and found:  # the volume's "PATH: not found (/a does not exist)"
        rest = rest.strip()
        return OSError(err, f"{os.strerror(err)}: {what}" + (f" {rest}" if rest else ""))
    return OSError(err, f"{os.strerror(err)}: {what} ({detail})")


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Run a volume call; its errors leave as OSError subclasses naming `what`."""
    try:
        yield
    except MetaError as e:
        raise as_os_error(e.errno or errno.EIO, what, str(e)) from None
    except VolumeError as e:
        text = str(e)
        err = errno.ENOENT if text.startswith("no volume at") else errno.EINVAL
        raise OSError(err, text) from None
    except (ChunkStoreError, NodeError) as e:
        raise OSError(errno.EIO, f"{what}: {e}") from None
