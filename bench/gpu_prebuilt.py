"""Taper's extensions built on the development machine for the lent GPU machine (issue 26).

Nothing is compiled on the GPU machine: its 15 minutes are for running. bench/gpu_build.sh builds
the extensions here for its Python (3.12), numpy ABI (2.5) and GPU (TAPER_CUDA_ARCHS=90a) and
stamps them; the GPU suite installs them into its copy of the tree, but only where the sources
they were compiled from are the tree's own, byte for byte:

    python -m bench.gpu_prebuilt stamp DIR      # after the build: DIR/BUILD.json
    python -m bench.gpu_prebuilt install DIR    # on the GPU machine: check, then copy into pyx/
    python -m bench.gpu_prebuilt travel .whl .gpu-prebuilt   # what a device call takes along

The stamp records the commit, the interpreter and numpy, the CUDA architectures and the SHA-256
of every source file the build reads (setup.py, pyx/ and cuda/ and cutlass_ext/ sources and
headers; the tree that travels has no .git, so the files themselves are the check). Install
exits 1 naming each file that differs, so a build older than the code can never be tested as if
it were the code.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What setup.py compiles or reads. Cython's generated C (pyx/backend.c, ...) is not a source:
# it is made from the .pyx, and only the tracked files are listed (see sources()).
SOURCE_PATTERNS = ("setup.py", "pyx/*.pyx", "pyx/*.pxd", "pyx/*.pxi", "pyx/*.c", "pyx/*.h",
                   "pyx/exports.map", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h",
                   "cutlass_ext/*.cu", "cutlass_ext/*.cuh", "cutlass_ext/*.h")


def sources(root: str) -> list[str]:
    """The source files of the build, relative to root: the tracked ones where git can say
    (generated C in pyx/ is ignored by git), else every match (the GPU machine's copy of the
    tree holds only tracked and unignored files)."""
    found = {os.path.relpath(p, root) for pat in SOURCE_PATTERNS
             for p in glob.glob(os.path.join(root, pat))}
    try:
        tracked = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return sorted(found)
    return sorted(found & set(tracked))


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def stamp(build_dir: str, root: str = ROOT) -> dict:
    """BUILD.json for the extensions in build_dir/pyx, built from root's sources."""
    import numpy
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    info = {
        "commit": commit,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "cuda_archs": os.environ.get("TAPER_CUDA_ARCHS", ""),
        "extensions": sorted(os.path.basename(p)
                             for p in glob.glob(os.path.join(build_dir, "pyx", "*.so"))),
        "sources": {rel: digest(os.path.join(root, rel)) for rel in sources(root)},
    }
    with open(os.path.join(build_dir, "BUILD.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def differences(info: dict, root: str) -> list[str]:
    """The source files whose bytes differ from the build's (or exist on one side only)."""
    here = {rel: digest(os.path.join(root, rel)) for rel in sources(root)}
    built = info["sources"]
    return sorted(rel for rel in set(here) | set(built) if here.get(rel) != built.get(rel))


def install(build_dir: str, root: str = ROOT) -> int:
    with open(os.path.join(build_dir, "BUILD.json")) as f:
        info = json.load(f)
    print(f"prebuilt: commit {info['commit']}, built {info['built']}, Python {info['python']}, "
          f"numpy {info['numpy']}, CUDA archs {info['cuda_archs'] or '(none)'}")
    here = sys.version.split()[0]
    if here.rsplit(".", 1)[0] != info["python"].rsplit(".", 1)[0]:
        print(f"prebuilt: built for Python {info['python']}, this is {here}", file=sys.stderr)
        return 1
    changed = differences(info, root)
    if changed:
        print(f"prebuilt: {len(changed)} source file(s) differ from the build's: "
              f"{', '.join(changed)}; rebuild with bash bench/gpu_build.sh", file=sys.stderr)
        return 1
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for name in info["extensions"]:
        if not name.endswith(suffix):
            print(f"prebuilt: {name} is not for this interpreter ({suffix})", file=sys.stderr)
            return 1
        shutil.copy2(os.path.join(build_dir, "pyx", name), os.path.join(root, "pyx", name))
    print(f"prebuilt: {len(info['extensions'])} extensions installed, sources match "
          f"({len(info['sources'])} files)")
    return 0


TRAVEL_LIMIT = 64 << 20     # the device tool's limit on the tree it sends, carried paths included


def travel(carry: list[str], root: str = ROOT) -> int:
    """Print what a device call sends (the tracked files present, the untracked ones git does not
    ignore, and the carried paths), largest first, and its total against the 64 MiB limit."""
    listed = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, text=True,
                            check=True).stdout.split("\n")
    files = {rel for rel in listed if rel and os.path.isfile(os.path.join(root, rel))}
    for path in carry:
        full = os.path.join(root, path)
        if os.path.isfile(full):
            files.add(path)
        for dirpath, _, names in os.walk(full):
            files.update(os.path.relpath(os.path.join(dirpath, n), root) for n in names)
    sizes = sorted(((os.path.getsize(os.path.join(root, f)), f) for f in files), reverse=True)
    total = sum(size for size, _ in sizes)
    for size, rel in sizes:
        print(f"{size / 2**20:9.2f} MiB  {rel}")
    verdict = "under" if total <= TRAVEL_LIMIT else "OVER"
    print(f"{len(sizes)} files, {total / 2**20:.1f} MiB: {verdict} the device call's "
          f"{TRAVEL_LIMIT >> 20} MiB")
    return 0 if total <= TRAVEL_LIMIT else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["stamp", "install", "travel"])
    ap.add_argument("dir", nargs="+", help="the prebuilt folder (its pyx/ holds the extensions); "
                    "for travel, the paths a device call carries")
    args = ap.parse_args(argv)
    if args.action == "travel":
        return travel(args.dir)
    args.dir = args.dir[0]
    if args.action == "stamp":
        info = stamp(args.dir)
        print(f"stamped {len(info['extensions'])} extensions of {info['commit']} "
              f"({len(info['sources'])} source files)")
        return 0
    return install(args.dir)


if __name__ == "__main__":
    sys.exit(main())
