"""Maintenance over a volume: fsck (check and repair), scrub (fsck that reads every replica)
and gc (unreferenced chunks and orphan objects after a grace period)."""
