#!/usr/bin/env bash
# Download, on a machine WITH network, the wheels a lent GPU machine lacks, into .whl/ (git-ignored).
#
# The GPU machines (see README, Development) run Python 3.12 with torch, pytest, nvidia-ml-py,
# prometheus-client, hypothesis and matplotlib already installed, but no pyzmq and no msgspec, and
# they reach no network. scripts/gpu-check.sh installs .whl/*.whl there into a private target.
# tomli is not needed (Python 3.12 has tomllib). Versions default to the ones in .venv, so the GPU
# run uses what the tests here ran with; override with GPU_WHEELS="pyzmq==X msgspec==Y".
#
#   bash scripts/gpu-wheels.sh            # then: device run with carry [".whl"], bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

dest=.whl
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
max_bytes=$((32 << 20))  # the device tool carries 64 MiB in all, the working tree included

pinned() {  # NAME -> NAME==VERSION installed here, else NAME
    local version
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) \
        && echo "$1==$version" || echo "$1"
}
if [ -n "${GPU_WHEELS:-}" ]; then
    read -r -a wanted <<<"$GPU_WHEELS"
else
    wanted=("$(pinned pyzmq)" "$(pinned msgspec)")
fi

# manylinux tags are matched exactly: name every glibc the GPU image (glibc 2.39) can run.
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 24 26 31 34 35 39; do
    platforms+=(--platform "manylinux_2_${n}_x86_64")
done

rm -rf "$dest.new"
mkdir -p "$dest.new"
echo "gpu-wheels: downloading ${wanted[*]} for cp312 manylinux x86_64 into $dest/" >&2
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest.new" "${wanted[@]}"
rm -rf "$dest"
mv "$dest.new" "$dest"

count=$(ls "$dest"/*.whl | wc -l)
if [ "$count" -ne "${#wanted[@]}" ]; then
    echo "gpu-wheels: expected ${#wanted[@]} wheels, got $count (two versions of one package stop the install)" >&2
    exit 1
fi
for whl in "$dest"/*.whl; do  # what each one needs; name any missing one in GPU_WHEELS
    needs=$(unzip -p "$whl" '*/METADATA' 2>/dev/null | grep '^Requires-Dist' | grep -v 'extra ==' \
            | grep -v "implementation_name == \"pypy\"" || true)
    echo "gpu-wheels: $(basename "$whl") $(stat -c %s "$whl") bytes${needs:+; needs: $needs}" >&2
done
total=$(du -cb "$dest"/*.whl | tail -n1 | cut -f1)
echo "gpu-wheels: $count wheels, $total bytes in $dest/" >&2
if [ "$total" -gt "$max_bytes" ]; then
    echo "gpu-wheels: over $max_bytes bytes: the device tool carries 64 MiB in all" >&2
    exit 1
fi
