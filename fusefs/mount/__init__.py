"""The FUSE mount: the pyfuse3 operations (fs.py), the per-mount file cache (filecache.py)
and the dirty blocks of files being written (blocks.py)."""
