"""Carry a large archive to the lent GPU machine in parts (stdlib only, Python 3.10+).

A ``run`` call carries at most 64 MiB with the working tree, and ignored paths there persist
between back-to-back calls, so a wheel set of hundreds of MB travels as parts:

    python scripts/carry.py split ARCHIVE PARTS_DIR [--part-mib 48]   # here
    python scripts/carry.py join PARTS_DIR ARCHIVE                    # there, after all parts
    python scripts/carry.py missing WHEEL_DIR IMAGE_PACKAGES.txt      # here: unmet requirements
    python scripts/carry.py fetch-relaxed WHEEL_DIR IMAGE_PACKAGES.txt ROOT...  # here: see below

``fetch-relaxed`` is the download when the index cannot resolve the whole set at once (vLLM
0.24.0 asks for llguidance >= 1.7, newer than the index's newest): one package at a time,
relaxing such a pin to the newest release there and saying so.

``split`` writes ``part-000``, ``part-001``, ... and ``manifest.json`` (each part's size and
sha256, and the whole archive's); each file is written under a temporary name and renamed, so
nothing half-written is ever taken for a part. ``join`` refuses, in one line naming the part,
a missing, short or corrupted part, and checks the whole archive's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import zipfile
from pathlib import Path

MANIFEST = "manifest.json"


class CarryError(ValueError):
    """A part or the archive is missing or damaged; the message names which."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def split(archive: Path, out_dir: Path, part_bytes: int) -> dict:
    """Cut ``archive`` into parts of ``part_bytes`` bytes under ``out_dir``; returns the
    manifest it wrote."""
    if part_bytes < 1:
        raise CarryError(f"--part-mib gives {part_bytes} bytes per part; give at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(archive, "rb") as fh:
        index = 0
        while chunk := fh.read(part_bytes):
            name = f"part-{index:03d}"
            _write_atomically(out_dir / name, chunk)
            parts.append(
                {"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
            )
            index += 1
    manifest = {
        "archive": archive.name,
        "bytes": archive.stat().st_size,
        "sha256": _sha256(archive),
        "parts": parts,
    }
    _write_atomically(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def join(parts_dir: Path, archive: Path) -> Path:
    """Reassemble the parts under ``parts_dir`` into ``archive``, each part and the whole
    checked against the manifest; raises ``CarryError`` naming the first bad part."""
    manifest_path = parts_dir / MANIFEST
    if not manifest_path.is_file():
        raise CarryError(f"{manifest_path}: no manifest; carry {MANIFEST} with the first part")
    manifest = json.loads(manifest_path.read_text())
    tmp = archive.with_name(archive.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in manifest["parts"]:
            path = parts_dir / part["name"]
            if not path.is_file():
                tmp.unlink()
                raise CarryError(f"{path}: missing; carry it (one run call per part)")
            data = path.read_bytes()
            if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                tmp.unlink()
                raise CarryError(f"{path}: damaged (size or sha256 differs); carry it again")
            out.write(data)
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise CarryError(f"{archive}: the joined archive's sha256 differs; carry the parts again")
    os.replace(tmp, archive)
    return archive


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing(wheel_dir: Path, image_packages: Path) -> list[str]:
    """Requirements (``Requires-Dist`` that apply on Linux x86-64 CPython 3.12 without extras,
    ``_requirements``) of the wheels in ``wheel_dir`` that neither a wheel there nor the
    image's package list (one name per line) provides."""
    have = {_normal(line.split()[0]) for line in image_packages.read_text().splitlines() if line}
    wheels = sorted(wheel_dir.glob("*.whl"))
    have |= {_normal(w.name.split("-")[0]) for w in wheels}
    unmet = set()
    for wheel in wheels:
        for spec in _requirements(wheel):
            name = _normal(re.split(r"[\s;<>=!~\[(]", spec, maxsplit=1)[0])
            if name not in have and not NEVER_CARRIED.match(name):
                unmet.add(f"{name} (needed by {wheel.name})")
    return sorted(unmet)


#: What ``fetch_relaxed`` passes pip for the GPU machine's wheels (CPython 3.12, x86-64 Linux).
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version", "3.12",
    "--implementation", "cp",
    "--abi", "cp312",
    "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64",
    "--platform", "any",
]  # fmt: skip
#: torch and its own companions: never carried (vLLM pins the machine's torch, and the image's
#: CUDA libraries, nvidia-*, are in its package list).
NEVER_CARRIED = re.compile(r"^(torch|torchvision|torchaudio|triton)$")


def _requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` entries of ``wheel`` that apply on Linux x86-64 CPython 3.12 without
    extras (markers evaluated with pip's own ``packaging``)."""
    from pip._vendor.packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "extra": ""}  # fmt: skip
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req).split(";")[0].strip())
    return out


def fetch_relaxed(wheel_dir: Path, roots: list[str], image_packages: Path) -> list[str]:
    """Download ``roots`` and their dependency closure for the GPU machine one package at a
    time (``pip download --no-deps``), leaving out what the image has (its package list, its
    torch). A pin the index cannot meet (e.g. a release newer than its newest) is relaxed
    to the newest release it has; returns those relaxations, one line each, for the closing
    note: the set installs with ``--no-deps`` on the machine, so a relaxed package must be
    one the job never imports (check there)."""
    import subprocess

    have = {_normal(line.split()[0]) for line in image_packages.read_text().splitlines() if line}
    wheel_dir.mkdir(parents=True, exist_ok=True)
    todo, seen, relaxed = list(roots), set(), []

    def download(spec: str) -> bool:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS]
        cmd += ["-d", str(wheel_dir), spec]
        return subprocess.run(cmd, capture_output=True, check=False).returncode == 0

    while todo:
        spec = todo.pop(0)
        name = _normal(re.split(r"[\s;<>=!~\[(]", spec, maxsplit=1)[0])
        if name in seen or name in have or NEVER_CARRIED.match(name):
            continue
        seen.add(name)
        before = set(wheel_dir.glob("*.whl"))
        if not download(spec):
            if not download(name):
                raise CarryError(f"{spec}: no wheel for cp312 x86-64 Linux in the index")
            relaxed.append(f"{spec} -> the index's newest")
        new = set(wheel_dir.glob("*.whl")) - before
        wheel = next(iter(new), None) or next(
            (w for w in wheel_dir.glob("*.whl") if _normal(w.name.split("-")[0]) == name), None
        )
        if wheel is not None:
            todo.extend(_requirements(wheel))
    return relaxed


def main(argv: list[str] | None = None) -> int:
    """``split`` / ``join`` / ``missing``; exit 2 with one line on a bad part or input."""
    parser = argparse.ArgumentParser(prog="carry", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("split")
    s.add_argument("archive", type=Path)
    s.add_argument("out_dir", type=Path)
    s.add_argument("--part-mib", type=float, default=48.0)
    j = sub.add_parser("join")
    j.add_argument("parts_dir", type=Path)
    j.add_argument("archive", type=Path)
    m = sub.add_parser("missing")
    m.add_argument("wheel_dir", type=Path)
    m.add_argument("image_packages", type=Path)
    r = sub.add_parser("fetch-relaxed")
    r.add_argument("wheel_dir", type=Path)
    r.add_argument("image_packages", type=Path)
    r.add_argument("roots", nargs="+")
    args = parser.parse_args(argv)
    try:
        if args.verb == "split":
            manifest = split(args.archive, args.out_dir, int(args.part_mib * (1 << 20)))
            print(f"{len(manifest['parts'])} parts of {args.archive} in {args.out_dir}")
        elif args.verb == "join":
            print(f"joined {join(args.parts_dir, args.archive)}")
        elif args.verb == "fetch-relaxed":
            relaxed = fetch_relaxed(args.wheel_dir, args.roots, args.image_packages)
            print("\n".join(f"relaxed: {line}" for line in relaxed) or "nothing relaxed")
        else:
            unmet = missing(args.wheel_dir, args.image_packages)
            print("\n".join(unmet) if unmet else "every requirement is met")
            return 1 if unmet else 0
    except (CarryError, OSError) as err:
        print(f"carry {args.verb}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
