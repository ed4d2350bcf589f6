"""A Hugging Face hub on 127.0.0.1 for tests (HF_ENDPOINT=hub.url), and a hub cache laid out by hand.

FakeHub answers the routes huggingface_hub's snapshot_download calls (read from huggingface_hub 1.31 and
2.4, which call the same ones):
    GET  /api/models/ORG/NAME/revision/REV       repo info: the commit `sha` a branch or tag names
    GET  /api/models/ORG/NAME/tree/COMMIT        the file listing (?recursive=true), sizes and blob ids
    HEAD /ORG/NAME/resolve/COMMIT/PATH           X-Repo-Commit, ETag, Content-Length of one file
    GET  /ORG/NAME/resolve/COMMIT/PATH           its bytes
and fails as the real hub does: 401 `X-Error-Code: RepoNotFound` for a repository it does not hold,
403 `GatedRepo` for a gated one without an accepted token, 404 `RevisionNotFound` for an unknown revision.
Every request's method and path is kept (`requests`), so a test sees what was downloaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


@dataclass
class Repo:
    """One model repository at one commit: repository path -> file on disk."""

    files: dict[str, Path]
    commit: str
    refs: tuple[str, ...] = ("main",)  # branches and tags that name the commit
    gated_token: str | None = None  # gated: only this token (Authorization: Bearer) may read it
    blob_ids: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.blob_ids = {path: _sha256(f) for path, f in self.files.items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_of(folder: Path) -> dict[str, Path]:
    """Every file under folder, by its path relative to it (as a repository lists it)."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_of(files: dict[str, Path]) -> str:
    """A 40-hex commit id derived from the files (stands for a git commit)."""
    h = hashlib.sha1()
    for path, f in sorted(files.items()):
        h.update(path.encode() + b"\0" + hashlib.sha1(f.read_bytes()).digest())
    return h.hexdigest()


class FakeHub:
    """The hub, serving `repos` (repo id -> Repo) from a thread of its own: `with FakeHub(repos) as hub:`."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-hub", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def downloaded(self, repo_id: str) -> set[str]:
        """The paths of repo_id whose bytes were asked for (GET on resolve)."""
        prefix = f"/{repo_id}/resolve/"
        return {p[len(prefix) :].split("/", 1)[1] for m, p in self.requests if m == "GET" and p.startswith(prefix)}

    def __enter__(self) -> FakeHub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    @web.middleware
    async def _record(self, request: web.Request, handler: object) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        return await handler(request)  # type: ignore[operator,no-any-return]

    def _repo(self, request: web.Request) -> Repo:
        """The repository the request names at its revision; raises the hub's errors."""
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _error(web.HTTPUnauthorized, "RepoNotFound", "Repository not found")
        if repo.gated_token is not None and request.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            raise _error(web.HTTPForbidden, "GatedRepo", f"Access to model {repo_id} is restricted.")
        if request.match_info["rev"] not in (repo.commit, *repo.refs):
            raise _error(web.HTTPNotFound, "RevisionNotFound", "Invalid rev id")
        return repo

    async def _info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        siblings = [{"rfilename": path} for path in repo.files]
        gated = "manual" if repo.gated_token else False
        return web.json_response(
            {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False, "gated": gated, "siblings": siblings}
        )

    async def _tree(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        listing = []
        for path, f in repo.files.items():
            size = f.stat().st_size
            entry = {"type": "file", "path": path, "size": size, "oid": repo.blob_ids[path][:40]}
            if path.endswith(".safetensors"):  # as the hub lists LFS files
                entry["lfs"] = {"oid": repo.blob_ids[path], "size": size, "pointerSize": 134}
            listing.append(entry)
        return web.json_response(listing)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        path = request.match_info["path"]
        if path not in repo.files:
            raise _error(web.HTTPNotFound, "EntryNotFound", f"{path} does not exist on {repo.commit}")
        f = repo.files[path]
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.blob_ids[path]}"'}
        if request.method == "HEAD":
            headers["Content-Length"] = str(f.stat().st_size)
            return web.Response(status=200, headers=headers)
        if request.method != "GET":
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        return web.Response(body=f.read_bytes(), headers=headers)


def _error(kind: type[web.HTTPException], code: str, message: str) -> web.HTTPException:
    return kind(headers={"X-Error-Code": code, "X-Error-Message": message}, text=message)


def write_hub_cache(cache_dir: Path, repo_id: str, files: dict[str, Path], commit: str, ref: str = "main") -> Path:
    """Lays out `files` in a huggingface_hub cache as a download would (models--ORG--NAME/ with blobs/ named
    by content hash, refs/REF holding the commit, snapshots/COMMIT/ of links into blobs/); the snapshot."""
    storage = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    for path, f in files.items():
        blob = storage / "blobs" / _sha256(f)
        if not blob.exists():
            blob.write_bytes(f.read_bytes())
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
