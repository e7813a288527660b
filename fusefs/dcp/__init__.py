"""torch.distributed.checkpoint backend: ranks write the volume directly, no FUSE in the path.

registry.py holds the per-process volumes and the resume helpers, writer.py the
StorageWriter (chunks cut at every item, published atomically through commit_rank),
reader.py the StorageReader, envelope.py the torch.save envelope around each item.
"""

from fusefs.dcp.reader import CkptfsReader
from fusefs.dcp.registry import (
    CkptfsError,
    close_volumes,
    drain,
    latest_step,
    parse_ckpt_path,
    resume_path,
    volume_for,
)
from fusefs.dcp.writer import CkptfsWriter

__all__ = [
    "CkptfsError",
    "CkptfsReader",
    "CkptfsWriter",
    "close_volumes",
    "drain",
    "latest_step",
    "parse_ckpt_path",
    "resume_path",
    "volume_for",
]
