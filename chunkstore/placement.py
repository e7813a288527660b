"""Placement is computed, not looked up: rendezvous (highest-random-weight) hashing.

Every client computes the same replica set from the chunk id and the node list,
so no metadata round trip is needed to find a chunk, and adding a node moves
only the chunks whose top-R set now includes it. Consecutive chunks of a file
have unrelated ids, so their replica sets are independent: a large file is
striped over all nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def rank_nodes(cid: bytes, names: Sequence[str]) -> list[int]:
    """Indexes of all nodes ordered by preference for this chunk."""
    scores = [(xxhash.xxh3_64_intdigest(cid, seed=_name_seed(n)), i) for i, n in enumerate(names)]
    scores.sort(reverse=True)
    return [i for _, i in scores]


def place(cid: bytes, names: Sequence[str], domains: Sequence[str], replicas: int) -> list[int]:
    """R node indexes for a chunk, in distinct failure domains while there are enough.

    When there are fewer domains than replicas, the remaining replicas go to the
    next-preferred nodes in already-used domains (still distinct nodes).
    """
    if replicas > len(names):
        raise ValueError(f"{replicas} replicas need at least {replicas} nodes, have {len(names)}")
    order = rank_nodes(cid, names)
    chosen: list[int] = []
    used: set[str] = set()
    for i in order:
        if domains[i] not in used:
            chosen.append(i)
            used.add(domains[i])
            if len(chosen) == replicas:
                return chosen
    for i in order:
        if i not in chosen:
            chosen.append(i)
            if len(chosen) == replicas:
                break
    return chosen


_seeds: dict[str, int] = {}


def _name_seed(name: str) -> int:
    s = _seeds.get(name)
    if s is None:
        s = _seeds[name] = xxhash.xxh3_64_intdigest(name.encode())
    return s
