#!/usr/bin/env bash
# The Python packages the GPU device machine's image lacks, as wheels in the repo's ignored .whl/ folder
# (a device call carries it: carry [".whl"]; bench/device/env.sh installs them into /tmp/site, never into
# the image). Run here, where pip reaches PyPI; the device machine is x86-64, CPython 3.12, and has no
# network. The image has torch, triton, transformers, msgpack, aiohttp; it lacks pyzmq, orjson, openai
# (with pydantic, httpx and the rest of its own needs), llguidance (structured outputs) and pytest-asyncio.
# NIXL is repacked by bench/device/nixl_wheel.py (the published wheel alone is near a call's 64 MiB).
#   bash bench/device/wheels.sh && python bench/device/nixl_wheel.py       (about 21 MiB in all)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
get() {  # pip matches each manylinux tag exactly: the ones these wheels are published under
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
get pyzmq orjson pytest-asyncio llguidance 'openai<3' pydantic pydantic-core jiter distro httpx httpcore anyio \
    sniffio h11 typing-inspection annotated-types typing_extensions
ls .whl
du -sh .whl
