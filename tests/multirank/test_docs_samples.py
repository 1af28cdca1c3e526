"""Runs the documentation's runnable code samples as real jobs, so none goes stale.

A sample is a fenced ```python block in docs/*.md preceded by the line
``<!-- run: np=N -->`` (an HTML comment: the site does not show it). Each runs as
written on N ranks through the launcher, under a timeout, and must exit 0.
"""
import os
import re

import pytest

import harness

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "docs")
_SAMPLE = re.compile(r"^<!-- run: np=(\d+) -->\n```python\n(.*?)^```", re.M | re.S)


def samples():
    found = []
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            with open(os.path.join(DOCS, name), encoding="utf-8") as f:
                text = f.read()
            for match in _SAMPLE.finditer(text):
                line = text.count("\n", 0, match.start()) + 2
                found.append(pytest.param(int(match.group(1)), match.group(2),
                                          id=f"{name}:{line}"))
    return found


def test_there_are_runnable_samples():
    assert len(samples()) >= 3


@pytest.mark.parametrize("np, source", samples())
def test_docs_sample_runs(native, np, source, tmp_path):
    script = tmp_path / "sample.py"
    script.write_text(source)
    harness.assert_ok(harness.run_job(np, str(script), timeout=240))
