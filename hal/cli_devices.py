"""Text rendering of `hal.describe()` for `crossrl devices`."""

from __future__ import annotations


def format_devices(info: dict) -> str:
    """A two-column table of what the HAL sees, then package versions."""
    names = info.get("device_names") or []
    rows = [
        ("backend", info.get("backend", "?")),
        ("available", ", ".join(info.get("available_backends", [])) or "-"),
        ("devices", str(info.get("device_count", 0))),
    ]
    rows += [(f"  [{i}]", name) for i, name in enumerate(names)]
    rows += [
        ("process group", info.get("process_group_backend", "?")),
        ("attention", info.get("attention_impl", "?")),
    ]
    kernels = info.get("kernels", {})
    if kernels:
        rows.append(("kernels (train.kernels=auto)", ""))
        rows += [(f"  {op}", name) for op, name in kernels.items()]
    rows += [
        ("visible-devices env", info.get("visible_devices_env") or "-"),
        ("ray resource", info.get("ray_resource", "?")),
    ]
    versions = info.get("versions", {})
    if versions:
        rows.append(("versions", ""))
        rows += [(f"  {pkg}", ver) for pkg, ver in versions.items()]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key.ljust(width)}  {value}".rstrip() for key, value in rows)


def main() -> int:
    """Print the table for the auto-selected backend; returns the exit status."""
    from hal.describe import describe

    print(format_devices(describe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
