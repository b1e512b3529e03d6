"""scripts/carry_closure.py: the slimmed GPU carry must hold every import that runs when the
engine's modules load. Synthetic wheels here; with the real set downloaded
(``bash scripts/gpu_carry.sh``) the last test checks the real slim set."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "carry_closure", ROOT / "scripts" / "carry_closure.py"
)
closure_mod = importlib.util.module_from_spec(_spec)
sys.modules["carry_closure"] = closure_mod  # its dataclass looks its module up there
_spec.loader.exec_module(closure_mod)

APP = {
    "app/__init__.py": "from . import engine\n",
    "app/engine.py": (
        "import dep\n"
        "from app.kernels import fast\n"
        "try:\n    import opt\nexcept ImportError:\n    opt = None\n"
        "if has_gone():\n    import gone\n    from app import gone_path\n"
        "if TYPE_CHECKING:\n    import typed\n"
        "def later():\n    import lazy\n"
    ),
    "app/kernels/__init__.py": "",
    "app/kernels/fast.py": "import os\nfrom ..util import helper\n",
    "app/util.py": "import numpy\n",
    "app/gone_path.py": "import gone\n",  # reached only through the guarded import
    "app/_C.abi3.so": "",
}


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\n")
    return path


@pytest.fixture
def wheels(tmp_path):
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    kept.mkdir()
    dropped.mkdir()
    _wheel(kept, "app", APP)
    for name in ("dep", "opt", "gone", "lazy", "typed"):
        _wheel(dropped, name, {f"{name}/__init__.py": ""})
    return kept, dropped


def _move(src: Path, dst: Path, name: str) -> None:
    (src / f"{name}-1.0-py3-none-any.whl").rename(dst / f"{name}-1.0-py3-none-any.whl")


def test_an_import_that_runs_of_a_dropped_package_fails_the_check(wheels):
    kept, dropped = wheels
    res = closure_mod.closure(sorted(kept.glob("*.whl")), sorted(dropped.glob("*.whl")), ["app"])
    assert not res.ok
    assert res.dropped == {"dep": {"app.engine"}}  # only the unguarded module-level import
    assert {"app.engine", "app.kernels.fast", "app.util", "app.gone_path"} <= res.reached
    assert res.outside == {"numpy": {"app.util"}}  # neither carried nor dropped: the image's


def test_guarded_lazy_and_typing_imports_may_be_dropped(wheels):
    kept, dropped = wheels
    _move(dropped, kept, "dep")  # carry the one that runs
    res = closure_mod.closure(sorted(kept.glob("*.whl")), sorted(dropped.glob("*.whl")), ["app"])
    assert res.ok and res.dropped == {}
    assert "dep" in res.reached


def test_a_required_root_that_is_not_carried_fails_and_a_traced_one_is_noted(wheels):
    kept, dropped = wheels
    _move(dropped, kept, "dep")
    res = closure_mod.closure(
        sorted(kept.glob("*.whl")), [], ["app", "app.old_module"], ("app.cuda_only",)
    )
    assert res.absent_roots == ["app.old_module"] and res.missing_roots == ["app.cuda_only"]
    assert not res.ok


def test_the_cli_exits_one_naming_the_dropped_package(wheels, tmp_path, capsys):
    kept, dropped = wheels
    roots = tmp_path / "roots.txt"
    roots.write_text("app\n")
    image = tmp_path / "image.txt"
    image.write_text("numpy\n")
    argv = [str(kept), str(roots), "--dropped", str(dropped), "--image", str(image)]
    assert closure_mod.main(argv) == 1
    out = capsys.readouterr().out
    assert "DROPPED but imported: dep (by app.engine)" in out
    assert "in the image: numpy" in out
    assert closure_mod.main([str(tmp_path / "none"), str(roots)]) == 2


CARRY = ROOT / ".carry"


@pytest.mark.skipif(
    not (CARRY / "slimmed").is_dir() or not any((CARRY / "wheels").glob("vllm-*.whl")),
    reason="the GPU carry is not downloaded here (bash scripts/gpu_carry.sh)",
)
def test_the_real_slim_set_holds_what_the_engine_imports():
    roots = (ROOT / "scripts" / "vllm_engine_modules.txt").read_text().split()
    cuda = tuple((ROOT / "scripts" / "vllm_cuda_roots.txt").read_text().split())
    res = closure_mod.closure(
        sorted((CARRY / "wheels").glob("*.whl")),
        sorted((CARRY / "slimmed").glob("*.whl")),
        roots,
        cuda,
    )
    assert res.ok, (res.dropped, res.missing_roots)
    assert "vllm.v1.attention.backends.flash_attn" in res.reached
