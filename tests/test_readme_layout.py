"""The README's Layout section names every file of the package (issue 19: a newcomer finds each file's job)."""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout() -> list[str]:
    s = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    block = s[s.index("## Layout"):]
    return block[:block.index("\n## ", 5)].splitlines()


def _named(rel: str, lines: list[str]) -> bool:
    d, f = os.path.split(rel)
    word = re.compile(r"(^|[\s/(|])" + re.escape(f) + r"($|[\s),|:])")
    return any(rel in line or (line.startswith(d + "/") and word.search(line)) for line in lines)


def test_every_package_file_is_in_the_layout():
    lines = _layout()
    missing = []
    for dp, _, fs in os.walk(os.path.join(REPO, "ampdoctor")):
        for f in fs:
            if f.endswith(".py") and f != "__init__.py":
                rel = os.path.relpath(os.path.join(dp, f), REPO).replace(os.sep, "/")
                if not _named(rel, lines):
                    missing.append(rel)
    assert not missing, f"README Layout does not name: {missing}"


def test_the_check_can_fail():
    assert not _named("ampdoctor/record/nosuchfile.py", _layout())
    assert _named("ampdoctor/record/step.py", _layout())
