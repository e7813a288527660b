"""Object nodes: where chunk objects live. One backend per file beneath this package
(dir.py: a local directory, s3.py: any S3 store through boto3), the short interface they
implement in base.py, and here the registry that turns a node URL into a backend."""

from __future__ import annotations

from chunkstore.nodes.base import NodeError, NodeInfo, ObjectMissing, ObjectNode

__all__ = ["NodeError", "NodeInfo", "ObjectMissing", "ObjectNode", "open_node", "parse_node_url"]


def parse_node_url(url: str, *, name: str, domain: str | None = None) -> NodeInfo:
    """Validate a node URL (`dir:/path` or `s3://bucket/prefix?...`) and its labels.

    A `domain=` query parameter on the URL sets the failure domain; by default
    every node is its own domain.
    """
    from urllib.parse import parse_qs, urlsplit

    if url.startswith("dir:"):
        path, _, query = url[4:].partition("?")
        if not path:
            raise ValueError(f"node {url!r}: dir: needs a path")
    elif url.startswith("s3://"):
        parts = urlsplit(url)
        if not parts.netloc:
            raise ValueError(f"node {url!r}: s3:// needs a bucket")
        query = parts.query
    else:
        raise ValueError(f"node {url!r}: expected dir:/path or s3://bucket/prefix")
    params = parse_qs(query)
    dom = domain or (params.get("domain") or [None])[0] or name
    return NodeInfo(name=name, url=url, domain=dom)


def open_node(info: NodeInfo, base_dir: str | None = None) -> ObjectNode:
    """Instantiate the backend for a node; relative dir: paths resolve against base_dir."""
    if info.url.startswith("dir:"):
        from chunkstore.nodes.dir import DirNode

        return DirNode(info, base_dir=base_dir)
    if info.url.startswith("s3://"):
        from chunkstore.nodes.s3 import S3Node

        return S3Node(info)
    raise ValueError(f"unknown node kind: {info.url!r}")
