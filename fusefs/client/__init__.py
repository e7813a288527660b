"""The volume client every frontend shares: the volume, its one chunk sink, the file writer
and reader, and the extent arithmetic they all use."""
