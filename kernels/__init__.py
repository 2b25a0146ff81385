"""Numerics for intellect-node, installed as ``intellect_kernels``.

A reference implementation of each kernel, in plain torch; fast paths join later behind the same functions.
Named ``intellect_kernels`` when installed because the name ``kernels`` is Hugging Face's: transformers (5.25 and
later) depends on that distribution and imports it. Where the repository's root is on ``sys.path`` (``python -m
pytest`` or ``python -m ...`` run from it), this folder would hide that package; imported as ``kernels``, it
hands the name over to the installed one instead (where none is installed, it stays this empty one: transformers
before 5.25 only probes for it, and does without).
"""

import sys


def _hand_over() -> None:
    """Load the ``kernels`` found on ``sys.path`` past this folder's parent into ``sys.modules["kernels"]``: the
    import that reached this file returns that module (importlib reads the name back after running it)."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or ".") != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:  # none installed: transformers before 5.25 probes the name, finds
        return  # this folder (empty here), and, with no such distribution, does without it
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over()
