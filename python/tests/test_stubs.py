"""The type stubs (``pensieve/_native.pyi``) say what the extension has: mypy's stubtest
compares them with the module as it loads, class by class and signature by signature."""

import subprocess
import sys


def test_the_stubs_match_the_extension():
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pensieve"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
