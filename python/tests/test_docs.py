"""docs/pytorch.md shows examples/pytorch_guard.py in full (the README test runs the page's commands
on the file): the page's first ```python block must be the file, byte for byte."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_page_shows_the_example_script_as_it_is():
    page = open(os.path.join(ROOT, "docs", "pytorch.md")).read()
    block = re.search(r"^```python\n(.*?)^```$", page, re.S | re.M).group(1)
    assert block == open(os.path.join(ROOT, "examples", "pytorch_guard.py")).read()
