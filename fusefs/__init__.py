"""What users touch: the volume client, the FUSE mount, the DCP backend, the CLI."""
