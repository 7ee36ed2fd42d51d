"""What the project ships: the GPU DeepSpeed configs step on enough tokens per GPU, and a plain wheel
carries the configs and finds them from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, pyproject
from pace import deadline


def test_every_shipped_gpu_config_steps_on_at_least_128k_tokens_per_gpu() -> None:
    """DeepSpeed's optimizer step costs a fixed time per step on a GPU: the GPU configs amortize it over
    at least 131,072 tokens per GPU at context 1,024, warm up as GPT-2's recipe does, and keep the
    schedule in the config consistent with the optimizer's rate."""
    from dsgpt2.optim.ds_config import precision

    gpu = {}
    for path in sorted((ROOT / "configs").glob("ds_config*.json")):
        ds = json.loads(path.read_text(encoding="utf-8"))
        if precision(ds) != "fp32":
            gpu[path.name] = ds
    assert {"ds_config.json", "ds_config_fp16.json", "ds_config_zero2_offload.json",
            "ds_config_zero3_offload.json"} <= set(gpu)  # fmt: skip
    for name, ds in gpu.items():
        tokens = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 1024
        assert tokens >= 131_072, (name, tokens)
        params = ds["scheduler"]["params"]
        assert params["warmup_max_lr"] == ds["optimizer"]["params"]["lr"], name
        assert 0 < params["warmup_num_steps"] <= 2000, name


@pytest.mark.slow
def test_the_wheel_carries_the_configs_and_finds_them_from_anywhere(tmp_path: Path) -> None:
    """A plain `pip install .` (the Docker image's) finds the shipped configs from any directory."""
    import zipfile

    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(ROOT)],
        capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("dsgpt2-*.whl")
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.json"))
    runs = sorted(p.name for p in (ROOT / "configs" / "recipes").iterdir())
    inside = sorted(Path(n).name for n in zipfile.ZipFile(wheel).namelist() if "/configs/" in n)
    assert inside == sorted(shipped + runs) and "ds_config_cpu.json" in inside and "demo.yaml" in runs
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import json, dsgpt2, dsgpt2.settings.shipped as s\n"
        "from pathlib import Path\n"
        "paths = [s.shipped_config(n) for n in s.shipped_names()]\n"
        "typed = ('configs/recipes/demo.yaml', 'ds_config_cpu.json', 'configs/nothing.json')\n"
        "named = [str(s.shipped_if_absent(Path(n))) for n in typed]\n"
        "print(json.dumps([dsgpt2.__file__, [str(p) for p in paths if json.loads(p.read_text())], named]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(target)}, timeout=deadline(120),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    where, paths, named = json.loads(result.stdout)
    assert where.startswith(str(target))
    # The README's paths, typed where there is no checkout: the shipped files; another name stays as typed.
    assert named[0] == str(Path(where).parent / "configs" / "recipes" / "demo.yaml")
    assert named[1] == str(Path(where).parent / "configs" / "ds_config_cpu.json")
    assert named[2] == "configs/nothing.json"
    assert sorted(Path(p).name for p in paths) == shipped
    assert all(p.startswith(str(target)) for p in paths)


def test_the_readmes_config_paths_read_the_shipped_files_where_there_is_no_checkout(tmp_path: Path) -> None:
    from conftest import run_cli

    info = run_cli("info", "--config", "configs/sample.json", cwd=tmp_path)
    said = f"configs/sample.json is not in {tmp_path}: the copy shipped with dsgpt2 is read"
    assert said in info.stderr, info.stderr
    # The sample config's local://runs/db, relative to where the command runs: no database there yet.
    assert info.returncode == 2 and f"local://{tmp_path}/runs/db: no database there" in info.stderr
    typo = run_cli("info", "--config", "configs/sampel.json", cwd=tmp_path)
    assert typo.returncode == 2 and "config file 'configs/sampel.json' not found" in typo.stderr
    # A configs/ of one's own without the file: a wrong name there, not the shipped file's place.
    (tmp_path / "own" / "configs").mkdir(parents=True)
    own = run_cli("info", "--config", "configs/sample.json", cwd=tmp_path / "own")
    assert own.returncode == 2 and "config file 'configs/sample.json' not found" in own.stderr


def test_the_package_metadata_states_every_licence_its_files_carry() -> None:
    """A file under another licence (its SPDX header) is named in the package's licence expression."""
    import re

    expression = pyproject()["project"]["license"]
    stated = set(re.findall(r"[A-Za-z0-9.+-]+", expression)) - {"AND", "OR", "WITH"}
    carried = set()
    for path in (ROOT / "dsgpt2").rglob("*.py"):
        header = path.read_text(encoding="utf-8")[:300]
        carried |= set(re.findall(r"SPDX-License-Identifier: ([A-Za-z0-9.+-]+)", header))
    assert "GPL-2.0-only" in carried and carried <= stated, (carried, expression)
