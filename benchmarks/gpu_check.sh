#!/usr/bin/env bash
# The GPU check on the GPU machine's own image: Python 3.12 and torch, but no Ray and no
# omegaconf, and nothing can be fetched there. What the parts need beside the image travels as
# pure-Python wheels in the git-ignored folder .whl/, is installed into a temporary site folder,
# and benchmarks/gpu_check.py runs with it ($OUT, where set, receives gpu_check.json and
# gpu_check.log). Only the parts that go through the CLI need Ray, and they say so and skip.
#
# The recipe, as `bash benchmarks/gpu_check.sh --dry-run` prints and checks it:
#   1. here, once, in the repository's root (PyYAML, rich, numpy, fsspec and nvidia-ml-py are in the image):
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0
#   2. carry: [".whl"]
#   3. command: bash benchmarks/gpu_check.sh
#      (about 6 minutes at most; `--quick` 3; `--only PART` reruns one part)
#
#   bash benchmarks/gpu_check.sh [--dry-run] [gpu_check.py's options]
#
# --dry-run prints the three and checks that every wheel is in .whl/ and that the working tree
# (tracked and untracked files git does not ignore) and .whl/ together fit in the 64 MiB that
# travel; exit code 1 if not. Without it: a missing wheel is named in one line and the check
# runs on (the parts that need it fail, each in one line); the exit code is gpu_check.py's, or 1
# where a wheel was missing. Nothing is written outside $OUT (or --out) and temporary folders.
# GPU_CHECK_WHEELS names another folder than .whl/ (the tests' stand-ins); PYTHON another python3.
set -u

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
WHEEL_DIR=${GPU_CHECK_WHEELS:-.whl}  # the carried folder, relative to the repository's root
WHEELS=(omegaconf-2.4.0-py3-none-any.whl)
REQUIREMENTS=(omegaconf==2.4.0)
DOWNLOAD="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $WHEEL_DIR ${REQUIREMENTS[*]}"
CARRY="[\"$WHEEL_DIR\"]"
COMMAND="bash benchmarks/gpu_check.sh"
LIMIT_BYTES=$((64 * 1024 * 1024))

missing_wheels() {
    local wheel found=0
    for wheel in "${WHEELS[@]}"; do
        if [ ! -f "$WHEEL_DIR/$wheel" ]; then
            echo "missing carried wheel: $WHEEL_DIR/$wheel (make it with: $DOWNLOAD)"
            found=1
        fi
    done
    return $found
}

tree_bytes() {
    # What travels: tracked and untracked-not-ignored files as they are on disk, and the carried folder.
    { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null
      [ -d "$WHEEL_DIR" ] && find "$WHEEL_DIR" -type f -printf '%s\n'; } | awk '{s += $1} END {print s + 0}'
}

if [ "${1:-}" = "--dry-run" ]; then
    echo "pip download: $DOWNLOAD"
    echo "carry: $CARRY"
    echo "command: $COMMAND"
    status=0
    missing_wheels || status=1
    bytes=$(tree_bytes)
    mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
    if [ "$bytes" -gt "$LIMIT_BYTES" ]; then
        echo "too large to travel: the working tree and $WHEEL_DIR/ hold $mib MiB, over 64 MiB"
        status=1
    else
        echo "size: the working tree and $WHEEL_DIR/ hold $mib MiB of the 64 MiB that travel"
    fi
    exit $status
fi

site=$(mktemp -d -t gpu-check-site-XXXXXX)
trap 'rm -rf "$site"' EXIT
wheel_status=0
missing_wheels >&2 || wheel_status=1
present=()
for wheel in "${WHEELS[@]}"; do
    [ -f "$WHEEL_DIR/$wheel" ] && present+=("$WHEEL_DIR/$wheel")
done
if [ ${#present[@]} -gt 0 ]; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "${present[@]}" || { echo "the carried wheels did not install into $site" >&2; wheel_status=1; }
fi
# The project from this working tree (the image has it nowhere else), the carried wheels before it.
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
"$PYTHON" benchmarks/gpu_check.py "$@"
status=$?
[ "$status" -eq 0 ] && status=$wheel_status
exit $status
