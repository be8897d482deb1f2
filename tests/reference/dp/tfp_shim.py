"""Import tensorflow_privacy submodules without its __init__ (which needs tf-estimator)."""

import os
import site
import sys
import types

root = os.path.join(
    next(p for p in site.getsitepackages() if os.path.isdir(os.path.join(p, "tensorflow_privacy"))),
    "tensorflow_privacy",
)
pkg = types.ModuleType("tensorflow_privacy")
pkg.__path__ = [root]
sys.modules["tensorflow_privacy"] = pkg
