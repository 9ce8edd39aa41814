"""`kernels` shares its import name with Hugging Face's kernel hub: transformers must not mistake it."""

from __future__ import annotations

import subprocess
import sys


def test_transformers_does_not_see_a_kernel_hub():
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available() is False


def test_importing_kernels_is_light():
    code = "import sys, kernels; print('torch' in sys.modules, hasattr(kernels, '__version__'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
