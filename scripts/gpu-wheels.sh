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
#   bash scripts/gpu-wheels.sh --ray      # also .whl/ray-site.tar.xz: Ray (the version in .venv) and what
#                                         # the GPU image lacks of its needs, trimmed to fit (~32 MB), for
#                                         # gpu-check's Ray GPU test (tests/ray/test_ray_gpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."
with_ray=0
for arg in "$@"; do
    case $arg in
        --ray) with_ray=1 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "gpu-wheels: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

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

[ "$with_ray" = 1 ] || exit 0
# Ray's wheel alone is 79 MB: installed for cp312 into a folder, without its Java jars, dashboard
# front end, RLlib and tests (none of which the loan path touches), and xz-compressed. Its needs that
# the GPU image does not have are named here (the image has pandas, pyarrow, fsspec, aiohttp, ...).
ray_needs=(ray jsonschema jsonschema-specifications referencing rpds-py tensorboardX pydantic pydantic_core
           annotated-types typing-inspection)
pins=()
for name in "${ray_needs[@]}"; do pins+=("$(pinned "$name")"); done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "gpu-wheels: installing ${pins[*]} for cp312 into a folder" >&2
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --target "$tmp/site" "${pins[@]}"
rm -rf "$tmp/site/ray/jars" "$tmp/site/ray/dashboard/client/build" "$tmp/site/ray/rllib" "$tmp/site/ray/tests"
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
tar -cf - -C "$tmp/site" . | xz -T0 -6 >"$dest/ray-site.tar.xz"
size=$(stat -c %s "$dest/ray-site.tar.xz")
echo "gpu-wheels: $dest/ray-site.tar.xz $size bytes" >&2
if [ $((total + size)) -gt $((56 << 20)) ]; then
    echo "gpu-wheels: wheels and Ray together are over 56 MiB: with the working tree, over what the device tool carries" >&2
    exit 1
fi
