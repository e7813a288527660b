"""torch.distributed.checkpoint backend: ranks write the volume directly, no FUSE in the path.

registry.py holds path parsing and the resume helpers (the per-process volumes are
fusefs.client.registry's), writer.py the
StorageWriter (chunks cut at every item, published atomically through commit_rank),
reader.py the StorageReader, envelope.py the torch.save envelope around each item.
"""

from fusefs.client.registry import close_volumes, drain, volume_for
from fusefs.dcp.reader import CkptfsReader
from fusefs.dcp.registry import CkptfsError, latest_step, parse_ckpt_path, resume_path
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
