"""Object nodes: where chunk objects live. One backend per file beneath this package
(dir.py: a local directory, s3.py: any S3 store through boto3), the short interface they
implement in base.py, and here the registry that turns a node URL into a backend."""

from __future__ import annotations

from chunkstore.nodes.base import NodeError, NodeInfo, ObjectMissing, ObjectNode

__all__ = [
    "NodeError",
    "NodeInfo",
    "ObjectMissing",
    "ObjectNode",
    "open_node",
    "parse_node_url",
    "redact_url",
]


def parse_node_url(url: str, *, name: str, domain: str | None = None) -> NodeInfo:
    """Validate a node URL (`dir:/path` or `s3://bucket/prefix?...`) and its labels.

    A `domain=` query parameter on the URL sets the failure domain; by default
    every node is its own domain.
    """
    from urllib.parse import parse_qs, urlsplit

    if url.startswith("dir:"):
        path, _, query = url[4:].partition("?")
        if not path:
            raise ValueError(f"node {redact_url(url)!r}: dir: needs a path")
    elif url.startswith("s3://"):
        parts = urlsplit(url)
        if not parts.netloc:
            raise ValueError(f"node {redact_url(url)!r}: s3:// needs a bucket")
        query = parts.query
    else:
        raise ValueError(f"node {redact_url(url)!r}: expected dir:/path or s3://bucket/prefix")
    params = parse_qs(query)
    given = sorted(SECRET_PARAMS & params.keys())
    if given:
        raise ValueError(
            f"node {redact_url(url)!r}: {', '.join(given)} on a node URL would be stored in "
            "the volume and shown to every client: give credentials by reference instead "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment, profile=NAME, "
            "or credentials_file=PATH)"
        )
    dom = domain or (params.get("domain") or [None])[0] or name
    return NodeInfo(name=name, url=url, domain=dom)


SECRET_PARAMS = frozenset({"access_key", "secret_key", "session_token", "password", "token"})


def redact_url(url: str) -> str:
    """The URL with the values of credential parameters replaced, for messages and logs."""
    base, sep, query = url.partition("?")
    if not sep:
        return url
    parts = []
    for item in query.split("&"):
        key, eq, _ = item.partition("=")
        parts.append(f"{key}=***" if eq and key in SECRET_PARAMS else item)
    return base + "?" + "&".join(parts)


def open_node(info: NodeInfo, base_dir: str | None = None) -> ObjectNode:
    """Instantiate the backend for a node; relative dir: paths resolve against base_dir."""
    if info.url.startswith("dir:"):
        from chunkstore.nodes.dir import DirNode

        return DirNode(info, base_dir=base_dir)
    if info.url.startswith("s3://"):
        from chunkstore.nodes.s3 import S3Node

        return S3Node(info)
    raise ValueError(f"unknown node kind: {info.url!r}")
