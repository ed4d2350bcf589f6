"""A cut-down NIXL wheel for the GPU device machine (device-only: never for users, who install pdserve[nixl]).

The device machine has no network: what it lacks travels in the repo's ignored .whl/ folder, 64 MiB in all
with everything else a call carries. The published nixl-cu13 / nixl-cu12 wheels are 59 / 69 MB: besides
NIXL's Python package, its core libraries and the UCX backend they bundle every other NIXL plugin (object
stores, GDS, GUSLI, libfabric, ...) with the libraries only those need (aws, azure, curl, libxml2, ...), a
second copy of the plugins, UCX's perftest modules, headers, example programs, and nixl_ep (expert
parallelism, ~90 MB unpacked). This script downloads one (pip download, PyPI) and repacks it:

  kept:    the Python package (<pkg>/), .<pkg>.mesonpy.libs/plugins/libplugin_UCX.so (the plugin directory
           NIXL loads from), UCX's transport modules for shared memory / tcp (in libuct), cma, cuda_copy /
           cuda_ipc / gdr_copy (libuct_cuda, libucm_cuda) and RDMA verbs (ib, ib_mlx5, ib_mlx5_ext; unless
           --no-rdma), and every bundled library those need, found by following their ELF NEEDED entries
           (auditwheel's renamed libfoo-1234abcd.so names make them unambiguous); libnixl.so itself needs
           grpc and etcd-cpp-api (its etcd metadata exchange), so those and their closure stay;
  dropped: everything else (listed with sizes when it runs);
  metadata: the version gets the local label +ucx (so a repacked wheel is never mistaken for the
           published one), Requires-Dist on nixl-ep / nixl_ep goes (none in 1.5.x, which bundles it as a
           package instead), RECORD is rewritten with the kept files' hashes.

    python bench/device/nixl_wheel.py                                  # nixl-cu13 1.5.1, cp312 -> .whl/
    python bench/device/nixl_wheel.py --cuda 12 --python-version 3.11 --out /tmp/w   # cu12 for this venv
    python bench/device/nixl_wheel.py --wheel path/to/nixl_cu13-...whl # repack a wheel already here
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from pathlib import Path, PurePosixPath

DEFAULT_VERSION = "1.5.1"
PLATFORM = "manylinux_2_28_x86_64"
LOCAL_LABEL = "ucx"
# UCX transport modules kept (nixl_cuXX.libs/ucx/libuct_<name>.so*, libucm_<name>.so*); shared memory
# (posix, sysv) and tcp live in libuct itself
UCX_MODULES = ("uct_cma", "uct_cuda", "ucm_cuda")
UCX_RDMA_MODULES = ("uct_ib", "uct_ib_mlx5", "uct_ib_mlx5_ext")
MIB = 1 << 20


def download(pkg: str, version: str, python_version: str, dest: Path) -> Path:
    """pip download of the one binary wheel of pkg==version for CPython python_version on manylinux x86_64."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--python-version", python_version, "--platform", PLATFORM, "-d", str(dest), f"{pkg}=={version}"]  # fmt: skip
    subprocess.run(cmd, check=True)
    (wheel,) = dest.glob("*.whl")
    return wheel


def needed(data: bytes) -> list[str]:
    """The NEEDED entries of an ELF shared object (readelf -d)."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def plan(files: dict[str, bytes], pkg: str, rdma: bool) -> tuple[set[str], dict[str, list[str]]]:
    """The wheel's paths to keep, and the system libraries (not bundled) each kept ELF file needs."""
    libs_dir, meson_dir = f"{pkg}.libs", f".{pkg}.mesonpy.libs"
    # where a NEEDED name resolves among the bundled libraries (the RPATHs point at these two folders)
    bundled = {PurePosixPath(p).name: p for p in files if p.startswith((f"{libs_dir}/", f"{meson_dir}/"))
               and "/" not in p.split("/", 1)[1] and is_elf(files[p])}  # fmt: skip
    modules = UCX_MODULES + (UCX_RDMA_MODULES if rdma else ())
    roots = [p for p in files if p.startswith(f"{pkg}/") and p.endswith(".so")]
    roots.append(f"{meson_dir}/plugins/libplugin_UCX.so")
    roots += [p for p in files if p.startswith(f"{libs_dir}/ucx/lib") and ".so" in p
              and PurePosixPath(p).name[3:].split(".so")[0] in modules]  # fmt: skip
    keep: set[str] = set()
    system: dict[str, list[str]] = {}
    todo = deque(roots)
    while todo:
        path = todo.popleft()
        if path in keep:
            continue
        if path not in files:
            raise SystemExit(
                f"{path}: not in the wheel (its layout changed: check the plugin and UCX folders)"
            )
        keep.add(path)
        for name in needed(files[path]):
            if name in bundled:
                todo.append(bundled[name])
            elif (sibling := PurePosixPath(path).parent.joinpath(name).as_posix()) in files:
                todo.append(sibling)  # a UCX module needing another
            else:
                system.setdefault(name, []).append(PurePosixPath(path).name)
    # the Python package's other files, the kept UCX modules' libtool files, the licenses
    for p in files:
        top = p.split("/", 1)[0]
        if (top == pkg and not p.endswith(".so")) or (p.endswith(".la") and p[:-3] + ".so.0.0.0" in keep):
            keep.add(p)
        if top.endswith(".dist-info") and (p.endswith(("METADATA", "WHEEL")) or "/licenses/" in p):
            keep.add(p)
    return keep, system


def metadata(text: str, version: str) -> str:
    """METADATA with the local version and without Requires-Dist on nixl-ep."""
    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith("Version: "):
            line = f"Version: {version}\n"
        if re.match(r"Requires-Dist:\s*nixl[-_]ep", line, re.I):
            continue
        lines.append(line)
    return "".join(lines)


def repack(src: Path, out_dir: Path, rdma: bool = True) -> Path:
    """Write the cut-down wheel of src into out_dir; return its path."""
    m = re.match(r"(?P<pkg>[^-]+)-(?P<ver>[^-]+)-(?P<tags>.+)\.whl$", src.name)
    if not m:
        raise SystemExit(f"{src.name}: not a wheel's file name")
    pkg, ver, tags = m["pkg"], m["ver"], m["tags"]
    new_ver = f"{ver.split('+')[0]}+{LOCAL_LABEL}"
    with zipfile.ZipFile(src) as z:
        files = {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
        zsize = {i.filename: i.compress_size for i in z.infolist()}
    keep, system = plan(files, pkg, rdma)
    old_info, new_info = f"{pkg}-{ver}.dist-info", f"{pkg}-{new_ver}.dist-info"
    out: dict[str, bytes] = {}
    for p in sorted(keep):
        data = files[p]
        if p == f"{old_info}/METADATA":
            data = metadata(data.decode(), new_ver).encode()
        out[p.replace(old_info, new_info, 1) if p.startswith(old_info + "/") else p] = data
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for p, data in out.items():
        writer.writerow([p, record_hash(data), len(data)])
    writer.writerow([f"{new_info}/RECORD", "", ""])
    out[f"{new_info}/RECORD"] = record.getvalue().encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{pkg}-{new_ver}-{tags}.whl"
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for p, data in out.items():
            info = zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if is_elf(data) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data, compresslevel=9)

    dropped: dict[str, list[int]] = {}
    for p in files:
        if p not in keep:
            parts = p.split("/")
            group = "/".join(parts[:2]) if len(parts) > 2 and parts[0] != pkg else parts[0]
            if parts[0].endswith(".libs") and len(parts) == 2:  # name the libraries themselves
                group = parts[1].split("-")[0].split(".so")[0]
            dropped.setdefault(group, [0, 0])
            dropped[group][0] += 1
            dropped[group][1] += zsize[p]
    print(f"{src.name}: {src.stat().st_size / MIB:.1f} MiB, {len(files)} files")
    print(f"{dst.name}: {dst.stat().st_size / MIB:.1f} MiB, {len(out)} files")
    print("kept libraries:", " ".join(sorted(PurePosixPath(p).name for p in keep if is_elf(files[p]))))
    print("dropped (files, MiB zipped):")
    for group, (n, size) in sorted(dropped.items(), key=lambda kv: -kv[1][1]):
        print(f"  {group}: {n}, {size / MIB:.2f}")
    print(
        "system libraries the kept ones need:", " ".join(f"{k} ({v[0]})" for k, v in sorted(system.items()))
    )
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".whl", help="where the repacked wheel goes (default .whl)")
    ap.add_argument("--cuda", choices=("12", "13"), default="13", help="nixl-cu12 or nixl-cu13 (default 13)")
    ap.add_argument("--python-version", default="3.12", help="the CPython the wheel is for (default 3.12)")
    ap.add_argument("--version", default=DEFAULT_VERSION, help=f"NIXL's version (default {DEFAULT_VERSION})")
    ap.add_argument("--wheel", default=None, help="repack this wheel instead of downloading one")
    ap.add_argument("--no-rdma", action="store_true", help="leave out UCX's RDMA verbs transports")
    args = ap.parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        src = (
            Path(args.wheel)
            if args.wheel
            else download(f"nixl-cu{args.cuda}", args.version, args.python_version, Path(tmp))
        )
        for old in out.glob(f"{src.name.split('-')[0]}-*.whl"):  # one nixl wheel in the folder, pip takes all
            if old.resolve() == src.resolve():
                continue
            print(f"replacing {old}")
            old.unlink()
        repack(src, out, rdma=not args.no_rdma)
    total = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{out}/*.whl: {total / MIB:.1f} MiB in all (a device call carries at most 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
