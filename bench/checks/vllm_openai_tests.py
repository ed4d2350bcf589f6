"""vLLM's own OpenAI-server tests, run against pdserve (issue 55's bar): the test files that hold the bar's
cases, copied at run time from a vLLM source tree into a temporary folder (vLLM's code never enters this
repository), with `tests.utils.RemoteOpenAIServer` standing for `pdserve serve --port P
--served-model-name NAME` and default flags otherwise (bench/checks/vllm_openai_shim.py says what else
is stood in for).

    .venv/bin/python bench/checks/vllm_openai_tests.py                   # the default files, ~10-20 min on CPU
    .venv/bin/python bench/checks/vllm_openai_tests.py --json out.json -- -k tokenizer_info

The vLLM tree: --vllm-src DIR (a git checkout or an unpacked sdist: DIR/tests/entrypoints/...), else
~/.cache/pdserve/vllm-src-VERSION, filled once from vLLM's sdist on PyPI (pip download --no-build-isolation
--no-clean: its metadata step fails without vLLM's build tools, the unpacked sdist is kept; it holds tests/).
The model: whatever `pdserve serve` serves by default (SmolLM2-135M-Instruct); every checkpoint name a test
gives is served under that name and its tokenizer/config read from --model-dir.

What it reports (stdout, and --json): passed / failed / errors / skipped, each of the bar's cases with its
outcome, and each failure's one-line reason; a bar case where pdserve differs from vLLM on purpose (ON_PURPOSE)
still fails, and says where that difference is written down. Counted apart:
- skipped: pytest's skips, plus the tests that take no server (vLLM-internal unit tests: vllm is stubbed);
- errors: a fixture pdserve's side cannot give (hf_runner, ...), a module that does not import.
A fresh server per server fixture (as vLLM's tests do), started and stopped by the shim. Tracebacks are
native (--tb=native): pytest's own formatting parses sources with ast and hit CPython 3.11's "AST constructor
recursion depth mismatch" on one of test_completion.py's failures, ending the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.34.0"
FILES = [  # under tests/entrypoints of vLLM 0.34.0: the files holding the bar's cases
    "serve/tokenize/test_tokenization.py",
    "serve/instrumentator/test_basic.py",
    "openai/chat_completion/test_chat_echo.py",
    "openai/completion/test_completion_with_prompt_embeds.py",
    "openai/completion/test_completion.py",
    "openai/chat_completion/test_chat.py",
    "serve/instrumentator/test_metrics.py",
]
BAR = {  # issue 55's bar: its case -> the vLLM tests (node id substrings) that are it
    "continuous usage stats, completions": ["test_completion.py::test_completion_stream_options"],
    "continuous usage stats, chat": ["test_chat.py::test_chat_completion_stream_options"],
    "chat echo with continue_final_message": [
        "test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message"
    ],
    "batch completions with beam search": ["test_completion.py::test_batch_completions"],
    "tokenizer_info endpoint": ["test_tokenization.py::test_tokenizer_info_"],
    "tokenize with tools": ["test_tokenization.py::test_tokenize_chat_with_tools"],
    "server load tracking": ["test_basic.py::test_server_load"],
    "invocations": ["::test_invocations"],
    "empty prompt_embeds beside a prompt": ["test_completion_with_prompt_embeds.py::test_empty_prompt_embeds"],
    "metrics: iteration tokens": ["test_metrics.py::test_metrics_counts", "test_metrics.py::test_metrics_exist"],
}
ON_PURPOSE = {  # a bar case -> why pdserve's answer differs from vLLM's on purpose, and where that is written down
    "tokenize with tools": "SmolLM2's template has no tools: vLLM renders them nowhere, chat and /tokenize alike; "
    "pdserve's chat sends its fallback tools prompt, and /tokenize counts what chat sends "
    "(docs/guides/coming-from-vllm.md, where pdserve differs on purpose)",
}

ROOT_CONFTEST = '''\
import pytest

import _pdserve_shim

_pdserve_shim.install_stubs()


@pytest.fixture(scope="session")
def local_asset_server():
    return _pdserve_shim.LocalAssetServer()


def pytest_collection_modifyitems(config, items):
    """A test with no server or client fixture exercises vLLM's internals (stubbed here): skipped."""
    for item in items:
        names = getattr(item, "fixturenames", [])
        if not any("server" in n or "client" in n for n in names):
            item.add_marker(pytest.mark.skip(reason="vLLM-internal unit test (no server; vllm is stubbed)"))
'''
PYTEST_INI = """\
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
pythonpath = .
markers =
    slow_test
    skip_global_cleanup
    core_model
    cpu_model
    cpu_test
    split
    distributed
    optional
"""


def vllm_source(version: str) -> Path:
    """~/.cache/pdserve/vllm-src-VERSION (tests/ and PKG-INFO of vLLM's sdist), fetched once."""
    dest = Path.home() / ".cache/pdserve" / f"vllm-src-{version}"
    if (dest / "tests/entrypoints").is_dir():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "--no-clean", "-d", f"{tmp}/dl"]  # fmt: skip
        print("fetching vLLM's sdist:", " ".join(cmd), flush=True)
        subprocess.run(cmd, env={**os.environ, "TMPDIR": tmp}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        trees = [p.parent for p in Path(tmp).glob("*/*/PKG-INFO") if (p.parent / "tests/entrypoints").is_dir()]
        if not trees:
            raise SystemExit(f"vLLM {version}'s sdist gave no tests/ tree: pass --vllm-src DIR (a vLLM checkout)")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(trees[0] / "tests", dest / "tests")
        shutil.copy(trees[0] / "PKG-INFO", dest / "PKG-INFO")
    return dest


def build_tree(src: Path, files: list[str], tmp: Path) -> None:
    """tmp/tests/...: the files, their packages' __init__.py and conftest.py (vLLM's tests/conftest.py
    and tests/utils.py replaced by the shim), tmp/conftest.py, pytest.ini."""
    shutil.copy(Path(__file__).with_name("vllm_openai_shim.py"), tmp / "_pdserve_shim.py")
    (tmp / "conftest.py").write_text(ROOT_CONFTEST)
    (tmp / "pytest.ini").write_text(PYTEST_INI)
    (tmp / "tests").mkdir()
    (tmp / "tests/__init__.py").write_text("")
    (tmp / "tests/utils.py").write_text("from _pdserve_shim import RemoteOpenAIServer  # noqa: F401\n")
    (tmp / "tests/conftest.py").write_text("from _pdserve_shim import LocalAssetServer  # noqa: F401\n")
    for rel in files:
        path = Path("tests/entrypoints") / rel
        if not (src / path).is_file():
            raise SystemExit(f"{src / path}: no such file in the vLLM tree")
        for parent in list(reversed(path.parents))[2:]:  # tests/entrypoints and below
            (tmp / parent).mkdir(exist_ok=True)
            for name in ("__init__.py", "conftest.py"):
                if (src / parent / name).is_file() and not (tmp / parent / name).exists():
                    shutil.copy(src / parent / name, tmp / parent / name)
        shutil.copy(src / path, tmp / path)


def node_id(case: ET.Element) -> str:
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):  # the module's dotted path, then any class
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py::" + "::".join([*parts[i:], name])
    return f"{classname}::{name}"


def one_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def summarize(junit: Path) -> dict[str, Any]:
    results: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = one_line(el.get("message")) or one_line(el.text)
                if reason.startswith("failed on setup"):  # the error itself: pytest's "E   ..." line
                    found = [ln for ln in f"{el.get('message')}\n{el.text}".splitlines() if ln.startswith("E ")]
                    reason = "setup: " + one_line(found[0][1:]) if found else reason
                break
        nid = node_id(case)
        if nid in results and outcome == "error" and results[nid]["outcome"] != "error":
            nid += " (teardown)"
        results[nid] = {"outcome": outcome, "reason": reason}
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "failed", "error", "skipped")}
    bar = {
        label: {nid: r for nid, r in results.items() if any(p in nid for p in pats)} for label, pats in BAR.items()
    }
    return {"counts": counts, "bar": bar, "on_purpose": ON_PURPOSE, "results": results}


def git_head() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-src", type=Path, help="a vLLM source tree (default: vLLM's sdist, cached)")
    ap.add_argument("--vllm-version", default=VLLM_VERSION)
    ap.add_argument("--files", nargs="+", default=FILES, help="test files under tests/entrypoints")
    ap.add_argument("--pdserve", default=str(REPO / ".venv/bin/pdserve"), help="the pdserve command")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/pdserve/models/smollm2-135m-instruct"),
                    help="the default model's folder: tokenizer and config for the tests' own use")  # fmt: skip
    ap.add_argument("--timeout", type=int, default=300, help="per test, seconds (pytest-timeout)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary tree and server logs")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = ap.parse_args()

    src = args.vllm_src or vllm_source(args.vllm_version)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-openai-tests-"))
    build_tree(src, args.files, tmp)
    junit = tmp / "junit.xml"
    env = {
        **os.environ,
        "PDSERVE_SHIM_CMD": json.dumps([args.pdserve]),
        "PDSERVE_SHIM_MODEL_DIR": args.model_dir,
        "PDSERVE_SHIM_LOG_DIR": str(tmp / "logs"),
        "VLLM_SHIM_VERSION": args.vllm_version,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(tmp),
    }
    cmd = [sys.executable, "-m", "pytest", "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp),
           "-p", "no:cacheprovider", f"--junitxml={junit}", "-rfE", "-q", "--tb=native", f"--timeout={args.timeout}",
           *[str(tmp / "tests/entrypoints" / f) for f in args.files], *args.pytest_args]  # fmt: skip
    started = datetime.datetime.now(datetime.timezone.utc)
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=tmp, env=env).returncode
    if not junit.exists():
        print(f"pytest wrote no report (rc={rc}); tree at {tmp}")
        return 1
    summary = summarize(junit)
    summary.update(
        date=started.strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_head(),
        vllm_version=args.vllm_version,
        files=args.files,
        wall_s=round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()),
        pytest_rc=rc,
    )
    c = summary["counts"]
    print(f"\n== vLLM {args.vllm_version} OpenAI tests vs pdserve {summary['commit']} ({summary['date']}, "
          f"{summary['wall_s']} s): {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
          f"{c['skipped']} skipped")  # fmt: skip
    print("\n== issue 55's bar")
    for label, cases in summary["bar"].items():
        if not cases:
            print(f"  {label}: NOT RUN (no such test collected)")
        for nid, r in cases.items():
            print(f"  {label}: {r['outcome'].upper()}  {nid}" + (f"  -- {r['reason']}" if r["outcome"] != "passed" else ""))
            if r["outcome"] != "passed" and label in ON_PURPOSE:
                print(f"    differs on purpose: {ON_PURPOSE[label]}")
    print("\n== failures and errors")
    for nid, r in summary["results"].items():
        if r["outcome"] in ("failed", "error"):
            print(f"  {r['outcome'].upper()} {nid}: {r['reason']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.keep:
        print(f"\ntree and server logs kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if c["failed"] == c["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
