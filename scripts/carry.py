"""Carry a large archive to the lent GPU machine in parts (stdlib only, Python 3.10+).

A ``run`` call carries at most 64 MiB with the working tree, and ignored paths there persist
between back-to-back calls, so a wheel set of hundreds of MB travels as parts:

    python scripts/carry.py split ARCHIVE PARTS_DIR [--part-mib 48]   # here
    python scripts/carry.py join PARTS_DIR ARCHIVE                    # there, after all parts
    python scripts/carry.py missing WHEEL_DIR IMAGE_PACKAGES.txt      # here: unmet requirements

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
    """Requirements (``Requires-Dist`` without an extra or environment marker that excludes
    Linux x86-64 CPython 3.12) of the wheels in ``wheel_dir`` that neither a wheel there nor
    the image's package list (one name per line) provides."""
    have = {_normal(line.split()[0]) for line in image_packages.read_text().splitlines() if line}
    wheels = sorted(wheel_dir.glob("*.whl"))
    have |= {_normal(w.name.split("-")[0]) for w in wheels}
    unmet = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            for line in zf.read(meta).decode("utf-8", "replace").splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                spec = line.split(":", 1)[1].strip()
                if ";" in spec:
                    marker = spec.split(";", 1)[1]
                    if "extra" in marker or "darwin" in marker or "win32" in marker:
                        continue
                name = _normal(re.split(r"[\s;<>=!~\[(]", spec, maxsplit=1)[0])
                if name not in have:
                    unmet.add(f"{name} (needed by {wheel.name})")
    return sorted(unmet)


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
    args = parser.parse_args(argv)
    try:
        if args.verb == "split":
            manifest = split(args.archive, args.out_dir, int(args.part_mib * (1 << 20)))
            print(f"{len(manifest['parts'])} parts of {args.archive} in {args.out_dir}")
        elif args.verb == "join":
            print(f"joined {join(args.parts_dir, args.archive)}")
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
