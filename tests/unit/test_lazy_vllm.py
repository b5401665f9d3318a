"""A learner process does not import vLLM until something uses it, and TorchRL's vLLM wrapper
still gets, from the first use on, exactly what its own import of vllm would have given it.

Each case runs in a fresh interpreter: what is imported, and in which order, is the subject.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support.vllm import needs_vllm

CHECK_WRAPPER = """
import json, sys
from torchrl.modules.llm.policies import vllm_wrapper as wrapper
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
finders = [type(finder).__name__ for finder in sys.meta_path]
print(json.dumps({
    "before": before,
    "has_vllm": wrapper._HAS_VLLM,
    "names": [
        wrapper.RequestOutput is RequestOutput,
        wrapper.SamplingParams is SamplingParams,
        wrapper.TokensPrompt is TokensPrompt,
    ],
    "finder_left": "_DeferVLLM" in finders,
}))
"""


def run_python(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code) + CHECK_WRAPPER],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_vllm
def test_a_learner_imports_vllm_only_when_torchrl_s_wrapper_asks_for_it():
    result = run_python(
        """
        import sys
        import titan_learner.learner.titan  # what every learner process imports
        from torchrl.modules.llm.policies import vllm_wrapper
        before = {
            "vllm_imported": "vllm" in sys.modules,
            "has_vllm": vllm_wrapper._HAS_VLLM,
            "sampling_params": vllm_wrapper.SamplingParams is None,
        }
        vllm_wrapper._require_vllm()  # what vLLMWrapper("model name") calls to build its engine
        """
    )
    assert result["before"] == {"vllm_imported": False, "has_vllm": True, "sampling_params": True}
    assert result["has_vllm"] and result["names"] == [True, True, True]
    assert not result["finder_left"]


@needs_vllm
def test_nothing_is_deferred_when_vllm_is_imported_first():
    result = run_python(
        """
        import vllm
        import titan_learner.learner.titan
        before = None
        """
    )
    assert result["has_vllm"] and result["names"] == [True, True, True]
    assert not result["finder_left"]
