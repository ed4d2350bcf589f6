"""bench/RESULTS.md is the index of the figure pages: every page is linked, every link resolves, and the
speed guard's baseline line reads as bench/device/speed_guard.sh reads it."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
INDEX = BENCH / "RESULTS.md"
SED = r"s/^Speed guard baseline: `\([0-9a-f]*\)`.*/\1/p"


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", path.read_text()) if not m.group(1).startswith("http")]


def test_index_links_every_page_and_every_link_resolves() -> None:
    pages = sorted((BENCH / "figures").glob("*.md"))
    assert pages, "no figure pages under bench/figures/"
    linked = {(INDEX.parent / link.split("#")[0]).resolve() for link in _links(INDEX)}
    assert [p.name for p in pages if p.resolve() not in linked] == []
    for page in [INDEX, *pages]:
        for link in _links(page):
            assert (page.parent / link.split("#")[0]).exists(), f"{page.name}: {link}"


def test_each_page_has_one_title_and_links_back_to_the_index() -> None:
    for page in sorted((BENCH / "figures").glob("*.md")):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and sum(line.startswith("# ") for line in lines) == 1, page.name
        assert "../RESULTS.md" in _links(page), page.name


@pytest.mark.skipif(shutil.which("sed") is None, reason="needs sed")
def test_speed_guard_reads_its_baseline_from_the_index() -> None:
    out = subprocess.run(["sed", "-n", SED, str(INDEX)], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"[0-9a-f]{7,40}\n", out), out
    script = (BENCH / "device" / "speed_guard.sh").read_text()
    assert SED in script and "bench/RESULTS.md" in script
