"""Shared fixtures. Fixture modules of each concern are plugins listed here."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fusefs.client.volume import Volume, VolumeSettings  # noqa: E402

# One line per concern's fixture module (tests/fixtures/*.py).
pytest_plugins: list[str] = [
    "tests.fixtures.seaweed",
    "tests.fixtures.postgres",
    "tests.fixtures.service",
    "tests.fixtures.mount",
    "tests.fixtures.fsspec_entry",
]


@pytest.fixture
def make_volume(tmp_path):
    """Factory: a fresh embedded volume in tmp_path; closed at teardown."""
    made: list[Volume] = []

    def make(name: str = "vol", nodes: int | list[str] = 4, **settings) -> Volume:
        vol = Volume.create(str(tmp_path / name), nodes=nodes, settings=VolumeSettings(**settings))
        made.append(vol)
        return vol

    yield make
    for v in made:
        v.close()


@pytest.fixture
def volume(make_volume) -> Volume:
    return make_volume()
