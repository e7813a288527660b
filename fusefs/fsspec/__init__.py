"""fsspec filesystem for the `ckptfs://` protocol (registered through the `fsspec.specs`
entry point in pyproject.toml, so `fsspec.open("ckptfs://...")` needs no import).

urls.py parses URLs and storage options into the volume to open, errors.py turns volume
errors into the exceptions fsspec users expect, files.py is the file object (FileWriter
and FileReader underneath: the one write path and read path every frontend uses), and
filesystem.py is the AbstractFileSystem itself.
"""

from fusefs.fsspec.filesystem import CkptfsFileSystem

__all__ = ["CkptfsFileSystem"]
