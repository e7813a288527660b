"""The metadata service (`ckptfs meta serve`): the trio server, its connections, the
group commit, batched reads and its counters."""
