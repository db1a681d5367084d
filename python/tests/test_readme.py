"""The README's Python example runs as written, and says what the cache saved."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_python_example_runs_and_reuses_the_first_turn():
    section = README.read_text().split("## In Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    reused = [int(n) for n in re.findall(r"\[reused (\d+) cached tokens", out.getvalue())]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 20, out.getvalue()
    assert "Paris" in out.getvalue()
