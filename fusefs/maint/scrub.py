"""scrub: read every replica of every chunk, verify it, rewrite bad ones from good ones.

Unlike fsck it does not compare refcounts or hunt orphans; it is the periodic
bit-rot sweep, so it takes a rate limit (MB/s of replica bytes read) to stay
out of the way of training jobs. It shares fsck's per-chunk engine.
"""

from __future__ import annotations

from fusefs.client.volume import Volume
from fusefs.maint.fsck import Report, check_volume


def scrub(
    vol: Volume,
    *,
    rate_mbps: float | None = None,
    repair: bool = True,
    progress: bool | None = None,
) -> Report:
    if rate_mbps is not None and rate_mbps <= 0:
        raise ValueError(f"--rate must be positive, got {rate_mbps}")
    return check_volume(
        vol,
        repair=repair,
        verify=True,
        consistency=False,
        rate_mbps=rate_mbps,
        progress=progress,
        label="scrub",
    )
