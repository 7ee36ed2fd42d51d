"""Train GPT-2 with DeepSpeed on a MongoDB corpus.

    deepspeed ds_trainer.py --deepspeed_config configs/ds_config.json --config_train configs/mongo.json ...
    python ds_trainer.py --deepspeed_config configs/ds_config_cpu.json --config_train ... --model_select tiny

`python ds_trainer.py --help` lists every flag.
"""

import importlib.util
import os
import sys
from pathlib import Path


def _ensure_environment() -> None:
    """Started by a Python without the toolkit (a fresh shell): run again in the project's .venv."""
    if all(importlib.util.find_spec(m) for m in ("torch", "deepspeed", "transformers")):
        return
    venv = Path(__file__).resolve().parent / ".venv" / "bin" / "python"
    if venv.is_file() and not os.environ.get("DSGPT2_REEXEC"):
        os.environ["DSGPT2_REEXEC"] = "1"  # once: a broken .venv must not loop
        os.execv(str(venv), [str(venv), __file__, *sys.argv[1:]])
    print(
        f"ds_trainer.py: error: {sys.executable} has no torch/deepspeed/transformers; run `make venv` "
        "(then .venv/bin/python ds_trainer.py, or source .venv/bin/activate) or pip install .",
        file=sys.stderr,
    )
    sys.exit(2)


if __name__ == "__main__":
    _ensure_environment()
    from dsgpt2.cli.main import run_trainer

    raise SystemExit(run_trainer(sys.argv[1:], prog="ds_trainer.py"))
