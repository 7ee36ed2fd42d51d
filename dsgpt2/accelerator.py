"""What DeepSpeed reads from the environment when it is imported, set right before it is.

Called by each place that imports DeepSpeed, never at import of a dsgpt2 module: `dsgpt2 generate`
or `serve` leave the environment as they found it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys

_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")


def prepare_deepspeed_environment() -> None:
    """Name the CPU accelerator where this machine has no GPU driver, and make the CUDA arch list
    one DeepSpeed's op builder can read. Idempotent; a user's own settings are kept."""
    # DeepSpeed warns on every start where it finds no GPU ("Setting accelerator to CPU..."); where
    # this machine has no GPU driver at all, say so first. Cheap: no torch import.
    if "DS_ACCELERATOR" not in os.environ and not any(os.path.exists(p) for p in _GPU_NODES):
        os.environ["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST as plain "M.N" numbers: an arch-specific
    # entry such as "9.0a" (set by CUDA images for Hopper) fails its JIT build of FusedAdam with
    # "invalid literal for int() with base 10: '0a'". The plain arch builds the same ops.
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    plain = re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", value)
    if plain != value:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain
    use_own_ninja()
    use_own_extensions_dir()


def extensions_dir() -> str:
    """Where this environment's DeepSpeed JIT ops are built and cached: ``TORCH_EXTENSIONS_DIR`` where
    the user set it, else a directory of this environment's own under ~/.cache/torch_extensions.

    torch's default (``py311_cpu``) is shared by every environment of one Python: each one's build
    files name its own torch's headers, so two environments read each other's op as stale and compile
    it again (1-3 minutes) at every switch."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return os.environ["TORCH_EXTENSIONS_DIR"]
    key = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = f"py{sys.version_info.major}{sys.version_info.minor}-{os.path.basename(sys.prefix)}-{key}"
    return os.path.join(cache, "torch_extensions", name)


def use_own_extensions_dir() -> None:
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()


def announce_cpu_op_build() -> None:
    """One line before DeepSpeed compiles its CPU communication op (the first CPU run of an
    environment), which is otherwise minutes of silence."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    built = shm_op_path()
    if not os.path.exists(built):
        logging.getLogger("dsgpt2").info(
            "compiling DeepSpeed's CPU communication op (once per environment, 1-3 min; cached in %s)",
            os.path.dirname(built),
        )


def shm_op_path() -> str:
    """Where DeepSpeed's compiled CPU communication op is cached for this environment."""
    return os.path.join(extensions_dir(), "deepspeed_shm_comm", "deepspeed_shm_comm.so")


def quiet_cached_op_load() -> None:
    """Keep DeepSpeed from printing "deepspeed_shm_comm_op built successfully" at every start: it
    prints it whether it compiled the op or loaded it from the cache, which reads as a rebuild each
    run. Loaded from the cache: nothing said; compiled now: one line saying so. Call before
    ``deepspeed.init_distributed``."""
    import contextlib
    import importlib
    import io

    # By name: the attribute ``deepspeed.comm.torch`` is torch itself, imported into that package.
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    original = ds_torch.build_shm_op
    if getattr(original, "quiet", False):
        return

    def build_shm_op() -> object:
        cached = os.path.exists(shm_op_path())
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            module = original()
        said = [line for line in printed.getvalue().splitlines() if not line.endswith(" built successfully")]
        for line in said:  # anything else it printed is the user's to see, as it was
            sys.stdout.write(line + "\n")
        if module is not None and not cached:
            logging.getLogger("dsgpt2").info("DeepSpeed's CPU communication op compiled, cached in %s",
                                             os.path.dirname(shm_op_path()))  # fmt: skip
        return module

    build_shm_op.quiet = True  # type: ignore[attr-defined]
    ds_torch.build_shm_op = build_shm_op


def use_own_ninja() -> None:
    """Have DeepSpeed's JIT builds (the CPU communication op, ~30 s to compile) run the ninja of
    this Python's environment, the one DeepSpeed depends on.

    torch runs whichever ``ninja`` comes first on PATH. Where a system ninja of another version is
    found first by some commands (an environment used without activating it) and the environment's
    by others, each one reads the other's build log as stale and compiles the op again: every
    switch costs a full build. The environment's bin directory goes first on PATH when it holds ninja.
    """
    own = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(own, "ninja")):
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != own:
        os.environ["PATH"] = os.pathsep.join([own, path]) if path else own
