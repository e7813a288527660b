"""Namespace and checkpoint coordination: engines, the trio service, its client."""
