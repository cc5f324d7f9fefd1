"""Import guard for torchvision in the CPU SGLang venv (ours, not SGLang's).

SGLang imports torchvision at start-up for multimodal processors it never runs on a
text model (e.g. `sglang/srt/multimodal/internvl_utils.py`); PyPI's torchvision wheels
are built against a CUDA torch and do not load with the CPU one. This stand-in lets
those imports succeed: every attribute of `torchvision` or any `torchvision.*` module is
a placeholder, and calling one raises ImportError naming it. transformers does not
mistake it for torchvision (no distribution metadata, so `is_torchvision_available()`
stays False).
"""

import importlib.abc
import importlib.machinery
import sys
import types

MESSAGE = "torchvision is not installed in the CPU SGLang venv (tests/sglang_cpu/torchvision is an import guard)"


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} was called: {MESSAGE}")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


class _GuardModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _GuardModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


__version__ = "0.0.0+guard"
sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str):  # torchvision's own attributes are placeholders too
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Unavailable(f"torchvision.{attr}")
