"""What crosses the network between clients and the service: the frame protocol and
TLS."""
