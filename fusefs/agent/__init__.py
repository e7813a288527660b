"""One ckptfs client per host and volume, shared by every rank on the host (issue 42).

`ckptfs agent VOLUME` (server.py) opens the volume once (its service connection, the
write-behind tier with its uploaders, the host read cache) and serves the host's ranks on
a Unix socket (paths.py) in the metadata wire protocol, forwarding each rank's requests
with the rank's own credential and grouping what many ranks ask at once (batch.py). A
rank finds it in fusefs.client.registry (rank.py); without one it runs its own client.
"""
