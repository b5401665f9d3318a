"""TorchRL's LLM policies without the cost of importing vLLM until something uses vLLM.

`torchrl.modules.llm.policies.vllm_wrapper` imports vllm at module level whenever vllm is
installed, for three names only (`RequestOutput`, `SamplingParams`, `TokensPrompt`), and every
learner imports it: TorchRL's LLM actor base class lives beside it, and its package imports it.
(TorchRL's own LLM package otherwise loads its vLLM backends on first use.) vllm's import takes
about 6 s of CPU on a 2-core machine, in every process: the CLI, each torchrun rank, each test
worker, whether the run uses vLLM or not.

`defer_vllm_import()` runs when titan_learner is imported, before any TorchRL module is:

- while that one module executes, `vllm` reads as not installed (`sys.modules["vllm"] = None`),
  so the module skips the import; then its `_HAS_VLLM` is set back to True (vllm is installed:
  `vLLMWrapper` imports it itself when it builds an engine from a model name);
- when vllm is imported (our `VLLMGenerator`, TorchRL's `AsyncVLLM` or `vLLMWrapper`, a user),
  the module gets the three names as its own import would have set them, before anything can
  hold a vLLM object to pass to it. So `vLLMWrapper` works as before; TorchRL's own comment in
  `_require_vllm` says it means to import vLLM lazily, as here.

It does nothing where vllm is not installed, is imported already, or where that module is.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

WRAPPER = "torchrl.modules.llm.policies.vllm_wrapper"
# What the wrapper imports from vllm, each under its own name: (module, name).
WRAPPER_NAMES = (
    ("vllm.outputs", "RequestOutput"),
    ("vllm.sampling_params", "SamplingParams"),
    ("vllm.inputs", "TokensPrompt"),
)


class _WrappedLoader(Loader):
    """The real loader with `around` (a context manager) around its `exec_module`; the rest is
    delegated (source lookups for tracebacks and `inspect` reach the real loader)."""

    def __init__(
        self, loader: Loader, around: Callable[[ModuleType], AbstractContextManager]
    ) -> None:
        self._loader = loader
        self._around = around

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self._around(module):
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _DeferVLLM(MetaPathFinder):
    """Wraps the loaders of the TorchRL wrapper (vllm hidden) and then of vllm (names handed
    over); leaves `sys.meta_path` once it has nothing left to do."""

    def __init__(self) -> None:
        self.deferred = False  # the wrapper ran with vllm hidden and still lacks its names

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == WRAPPER:
            around = self._vllm_hidden
        elif fullname == "vllm" and self.deferred:
            around = self._then_hand_over
        else:
            return None
        spec = self._real_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappedLoader(spec.loader, around)
        return spec

    def _real_spec(self, fullname: str, path: Any, target: ModuleType | None) -> ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None

    @contextmanager
    def _vllm_hidden(self, wrapper: ModuleType) -> Iterator[None]:
        hidden = "vllm" not in sys.modules
        if hidden:
            sys.modules["vllm"] = None  # importlib: not installed (find_spec returns None)
        try:
            yield
            if hidden:  # installed, as the wrapper's own lazy import (`_require_vllm`) asks
                wrapper._HAS_VLLM = True
            self.deferred = hidden
        finally:
            if hidden and sys.modules.get("vllm", ...) is None:
                del sys.modules["vllm"]
            if not self.deferred:
                self._leave()

    @contextmanager
    def _then_hand_over(self, _vllm: ModuleType) -> Iterator[None]:
        yield  # where vllm's own import fails, its error leaves here: nothing to hand over
        self._leave()
        wrapper = sys.modules.get(WRAPPER)
        if wrapper is None:
            return
        for module_name, name in WRAPPER_NAMES:
            try:
                value = getattr(importlib.import_module(module_name), name)
            except (ImportError, AttributeError):  # as the wrapper does: older vllm, no name
                value = None
            setattr(wrapper, name, value)

    def _leave(self) -> None:
        self.deferred = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def defer_vllm_import() -> None:
    """Install the deferral once, if it can still save the import (see the module docstring)."""
    if WRAPPER in sys.modules or "vllm" in sys.modules:
        return
    if any(isinstance(finder, _DeferVLLM) for finder in sys.meta_path):
        return
    if importlib.util.find_spec("vllm") is None:
        return
    sys.meta_path.insert(0, _DeferVLLM())
