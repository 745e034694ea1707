#!/usr/bin/env bash
# One command: set everything up, then run the whole test suite on the CPU.
# Arguments go to pytest: `bash scripts/test.sh tests/test_engine.py`, `-k prefix`, `-m unit`, `-q`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# The Redis KV tier's tests start their own redis-server on loopback: make sure there is one.
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  { $SUDO apt-get install -y -q redis-server >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q redis-server >/dev/null 2>&1; }; } \
    || { echo "error: redis-server is needed by the KV tier tests and could not be installed" >&2; exit 1; }
fi
. .venv/bin/activate
# Bytecode caches on: pytest keeps each test module's rewritten asserts in __pycache__ and Python
# the compiled modules, so runs after the first skip rewriting and compiling them
# (PYTHONDONTWRITEBYTECODE, set by some images, would forbid both).
unset PYTHONDONTWRITEBYTECODE
# glibc returns freed memory at the top of the heap to the kernel and serves large blocks from
# fresh mappings, so the engines' float32 temporaries (a step's activations, weights dequantized
# at load) fault their pages in anew each time. Keep freed memory mapped, as PyTorch's caching
# allocator does on a GPU: the same tests, a fraction of the page faults (two parity tests in one
# process: 77 s -> 72 s, half the system time; the suite's system time 4.6 -> 3.4 minutes).
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
export MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-536870912}"
# The whole suite (tests/) unless an argument names a path (a file, directory or node id): then
# only what it names, so a file or -k/-m selection narrows the run instead of adding to it. An
# option's value that happens to be a path (-k tests) only drops `tests` here; pytest then runs
# its testpaths, which are tests/ too.
paths=()
for a in "$@"; do
  case "$a" in -*) ;; *) [ -e "${a%%::*}" ] && paths+=("$a") ;; esac
done
# The whole suite runs on up to 4 pytest-xdist workers (one per core), a file's tests together on
# one worker so its module fixtures (servers, engines) start once, files handed out in the order
# tests/conftest.py gives them (the longest first); -n or -p no:xdist overrides.
if [ "${#paths[@]}" -eq 0 ]; then
  set -- tests "$@"
  case " $* " in *" -n "*|*" -n="*|*" --numprocesses"*|*"no:xdist"*) ;; *)
    n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4
    [ "$n" -gt 1 ] && set -- -n "$n" --dist loadfile --no-loadscope-reorder "$@" ;;
  esac
fi
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
