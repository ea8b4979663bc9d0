"""A local stand-in for the Hugging Face Hub HTTP API, for tests (stdlib only).

It serves the routes ``huggingface_hub`` calls to create a repo, commit to it (preupload, git-LFS batch
and pre-signed PUT, NDJSON commit) and read it back (repo info, tree, resolve with Range, commits,
refs), with the Hub's response and error shapes. It does not speak Xet and never advertises it (no
``xetHash``, no ``X-Xet-*`` headers), so downloads use plain HTTP; uploads must have Xet switched off
on the client side (see ``neuron_parallel.hub``).

State lives under ``root``: content-addressed blobs in ``blobs/<sha256>`` and one JSON document per
repo in ``repos/<type>/<namespace>/<name>.json`` with its commits and branch heads.

A test can make commit requests fail for real (``LocalHub.fail_next_commit``): the server drops the
connection halfway through the request, or after committing, without an answer.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

MAX_BODY_BYTES = 2 * 1024**3
DEFAULT_USERS = {"hf_localhub_write_token": "local-user"}
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
# As on the Hub: big files, binary files and the suffixes of its default .gitattributes go to LFS.
LFS_MIN_SIZE = 10 * 1024 * 1024
LFS_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".onnx",
    ".gguf",
    ".npy",
    ".npz",
    ".msgpack",
    ".model",
    ".parquet",
    ".arrow",
    ".zip",
    ".gz",
    ".tar",
)
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REPO = r"/api/(models|datasets|spaces)/([^/]+)/([^/]+)"
_OPT_PREFIX = r"/(?:(datasets|spaces)/)?([^/]+)/([^/]+)"
_ROUTES: list[tuple[tuple[str, ...], re.Pattern[str], str]] = [
    (("GET",), re.compile(r"/api/whoami-v2"), "whoami"),
    (("POST",), re.compile(r"/api/repos/create"), "create_repo"),
    (("POST",), re.compile(r"/api/validate-yaml"), "validate_yaml"),
    (("GET", "HEAD"), re.compile(_REPO + r"(?:/revision/([^/]+))?"), "repo_info"),
    (("POST",), re.compile(_REPO + r"/preupload/([^/]+)"), "preupload"),
    (("POST",), re.compile(_REPO + r"/commit/([^/]+)"), "commit"),
    (("GET",), re.compile(_REPO + r"/tree/([^/]+)(?:/(.*))?"), "tree"),
    (("GET",), re.compile(_REPO + r"/commits/([^/]+)"), "commits"),
    (("GET",), re.compile(_REPO + r"/refs"), "refs"),
    (("POST",), re.compile(_OPT_PREFIX + r"\.git/info/lfs/objects/batch"), "lfs_batch"),
    (("PUT",), re.compile(r"/lfs-upload/([0-9a-f]{64})"), "lfs_put"),
    (("GET", "HEAD"), re.compile(_OPT_PREFIX + r"/resolve/([^/]+)/(.+)"), "resolve"),
]


class _DropConnection(Exception):
    """Close the client's connection without an answer (a fault the test asked for)."""


class HubError(Exception):
    """An error answered in the Hub's shape: JSON ``{"error": ..., **extra}`` and ``X-Error-*`` headers."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: Mapping[str, str] = {}, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers, self.extra = dict(headers), extra


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    """What git stores for an LFS file: its git oid is the pointer's, not the content's."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _check_repo_path(path: object) -> str:
    """A file path inside a repo: relative, '/'-separated, no empty, '.' or '..' parts."""
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or "\\" in path
        or "\0" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise HubError(400, f"Invalid path in repo: {path!r}", "InvalidPath")
    return path


class _Store:
    """Blobs and per-repo JSON state under ``root``; ``lock`` serialises every repo mutation."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        for sub in ("blobs", "repos", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def _state_path(self, rtype: str, repo_id: str) -> Path:
        namespace, name = repo_id.split("/")
        return self.root / "repos" / rtype / namespace / f"{name}.json"

    def load(self, rtype: str, repo_id: str) -> dict[str, Any] | None:
        path = self._state_path(rtype, repo_id)
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, rtype: str, repo_id: str, state: dict[str, Any]) -> None:
        path = self._state_path(rtype, repo_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write_atomically(path, json.dumps(state).encode())

    def write_atomically(self, path: Path, data: bytes) -> None:
        tmp = self.root / "tmp" / uuid.uuid4().hex
        tmp.write_bytes(data)
        os.replace(tmp, path)  # concurrent readers never see a half-written file

    def blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def put_bytes(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        if not self.blob(sha256).exists():
            self.write_atomically(self.blob(sha256), data)
        return sha256


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, store: _Store, users: Mapping[str, str], max_body: int, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.store, self.users, self.max_body = store, dict(users), max_body
        self.secret = secrets.token_bytes(32)  # signs the pre-signed LFS upload URLs
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.commit_faults: list[str] = []  # "cut" or "lost", for the next commit requests in turn
        self.dropped_commits = 0

    def take_commit_fault(self) -> str | None:
        with self.store.lock:
            if not self.commit_faults:
                return None
            self.dropped_commits += 1
            return self.commit_faults.pop(0)


class _Handler(BaseHTTPRequestHandler):
    """One request: route it, run its ``_h_<route>`` method, turn ``HubError`` into the Hub's answer."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args) -> None:
        """Quiet: failures surface as HTTP errors in the client, not as access-log lines."""

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_GET

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        try:
            for methods, pattern, name in _ROUTES:
                match = pattern.fullmatch(url.path)
                if match and self.command in methods:
                    return getattr(self, f"_h_{name}")(*(g if g is None else unquote(g) for g in match.groups()))
            raise HubError(404, f"Sorry, we can't find the page you are looking for: {url.path}")
        except HubError as err:
            self._error(err)
        except _DropConnection:
            self.close_connection = True  # closing with the body half read makes the kernel send a reset
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-response
        except Exception as err:  # a bug in this stand-in: say so loudly rather than hang the client
            traceback.print_exc(file=sys.stderr)
            self._error(HubError(500, f"LocalHub internal error: {err!r}"))

    def _error(self, err: HubError) -> None:
        # The request body may be unread, so this socket cannot carry another request: say so and close.
        self.close_connection = True
        headers = {**err.headers, "X-Error-Message": err.message, "Connection": "close"}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, {"error": err.message, **err.extra}, headers)

    # -- responses and request bodies ----------------------------------------------------------------

    def _send(self, status: int, body: Any, headers: Mapping[str, str] = {}, ctype: str = "application/json") -> None:
        """Answer ``body`` (bytes as they are, anything else as JSON); HEAD gets the headers only."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": ctype, "Content-Length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body_chunks(self) -> Iterator[bytes]:
        """The request body, streamed. Like S3 for uploads, it needs a Content-Length (the client sends one)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise HubError(411, "Content-Length is required", "MissingContentLength")
        remaining = int(self.headers.get("Content-Length") or 0)
        if not 0 <= remaining <= self.server.max_body:
            raise HubError(413, f"Request body larger than {self.server.max_body} bytes")
        while remaining > 0:
            if not (chunk := self.rfile.read(min(remaining, 1 << 20))):
                raise HubError(400, "Request body ended early")
            remaining -= len(chunk)
            yield chunk

    def _json_body(self) -> Any:
        try:
            return json.loads(b"".join(self._body_chunks()) or b"{}")
        except ValueError as err:
            raise HubError(400, f"Malformed JSON body: {err}") from None

    # -- auth, repos and revisions -------------------------------------------------------------------

    def _user(self, *, required: bool) -> str | None:
        header = self.headers.get("Authorization")
        if header is None:
            if required:
                raise HubError(401, "Invalid username or password.")
            return None
        scheme, _, token = header.partition(" ")
        user = self.server.users.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, plural: str | None, namespace: str, name: str, *, write: bool) -> tuple[str, str, dict[str, Any]]:
        """(type, repo id, state) of an existing repo the caller may read, or write if ``write``."""
        rtype, repo_id = REPO_TYPES[plural or "models"], f"{namespace}/{name}"
        user = self._user(required=write)
        valid = _NAME.fullmatch(namespace) and _NAME.fullmatch(name) and ".." not in name
        state = self.server.store.load(rtype, repo_id) if valid else None
        if state is None or (state["private"] and user != namespace):  # the Hub hides private repos
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write and user != namespace:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return rtype, repo_id, state

    def _revision(self, state: dict[str, Any], revision: str) -> str:
        if revision in state["refs"]:
            return state["refs"][revision]
        if revision in state["commits"]:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _repo_url(self, rtype: str, repo_id: str) -> str:
        return f"{self.server.url}/{URL_PREFIXES[rtype]}{repo_id}"

    # -- handlers ------------------------------------------------------------------------------------

    def _h_whoami(self) -> None:
        user = self._user(required=True)
        auth = {"type": "access_token", "accessToken": {"displayName": "localhub", "role": "write"}}
        self._send(200, {"type": "user", "id": user, "name": user, "fullname": user, "orgs": [], "auth": auth})

    def _h_create_repo(self) -> None:
        user = self._user(required=True)
        body = self._json_body()
        rtype, name, namespace = body.get("type") or "model", body.get("name"), body.get("organization") or user
        if rtype not in URL_PREFIXES or not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            raise HubError(400, f"Invalid repo name or type: {name!r} ({rtype!r})")
        if namespace != user:
            raise HubError(403, f"You don't have the rights to create a {rtype} under the namespace {namespace}")
        repo_id, store = f"{namespace}/{name}", self.server.store
        with store.lock:
            if store.load(rtype, repo_id) is not None:
                # The Hub's 409 carries the repo url: create_repo(exist_ok=True) returns it.
                raise HubError(409, f"You already created this {rtype} repo", url=self._repo_url(rtype, repo_id))
            commit_id = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
            gitattributes = {
                "sha256": store.put_bytes(GITATTRIBUTES),
                "size": len(GITATTRIBUTES),
                "oid": _git_oid(GITATTRIBUTES),
                "lfs": False,
            }
            initial = {
                "parents": [],
                "title": "initial commit",
                "message": "",
                "author": user,
                "date": _now(),
                "files": {".gitattributes": gitattributes},
            }
            private = bool(body.get("private")) or body.get("visibility") == "private"
            store.save(
                rtype,
                repo_id,
                {"private": private, "created": _now(), "refs": {"main": commit_id}, "commits": {commit_id: initial}},
            )
        self._send(200, {"url": self._repo_url(rtype, repo_id), "name": repo_id, "id": repo_id})

    def _h_validate_yaml(self) -> None:
        # create_commit posts README.md here first. The Hub checks the metadata schema; this only warns on none.
        content = str(self._json_body().get("content", ""))
        has_yaml = re.match(r"\s*---\r?\n[\s\S]*?\r?\n---[ \t]*(\r?\n|$)", content) is not None
        warnings = [] if has_yaml else [{"message": "Empty or missing yaml metadata in repo card"}]
        self._send(200, {"errors": [], "warnings": warnings})

    def _h_repo_info(self, plural: str, namespace: str, name: str, revision: str | None) -> None:
        rtype, repo_id, state = self._repo(plural, namespace, name, write=False)
        sha = self._revision(state, revision or "main")
        commit = state["commits"][sha]
        siblings = [
            {"rfilename": path, "size": f["size"], "blobId": f["oid"]}
            | ({"lfs": {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}} if f["lfs"] else {})
            for path, f in sorted(commit["files"].items())
        ]
        info = {
            "_id": repo_id,
            "id": repo_id,
            "author": namespace,
            "sha": sha,
            "private": state["private"],
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "lastModified": commit["date"],
            "createdAt": state["created"],
        }
        self._send(200, info | {"modelId": repo_id} if rtype == "model" else info)

    def _h_preupload(self, plural: str, namespace: str, name: str, revision: str) -> None:
        _, _, state = self._repo(plural, namespace, name, write=True)
        sha = self._revision(state, revision)
        current, answers = state["commits"][sha]["files"], []
        for item in self._json_body().get("files", []):
            path, size = _check_repo_path(item.get("path")), int(item.get("size", 0))
            sample = base64.b64decode(item.get("sample", ""))
            lfs = size >= LFS_MIN_SIZE or path.endswith(LFS_SUFFIXES) or b"\0" in sample
            known = current.get(path)
            # The client leaves out files whose oid matches: sha256 for LFS, git blob sha1 otherwise.
            oid = None if known is None or known["lfs"] != lfs else (known["sha256"] if lfs else known["oid"])
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._send(200, {"files": answers, "commitOid": sha})

    def _h_lfs_batch(self, plural: str | None, namespace: str, name: str) -> None:
        self._repo(plural, namespace, name, write=True)
        body, store, objects = self._json_body(), self.server.store, []
        if body.get("operation") != "upload":
            raise HubError(400, "Only the upload operation is supported")
        expires = int(time.time()) + 3600
        for obj in body.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not _SHA256.fullmatch(oid) or not isinstance(size, int) or size < 0:
                raise HubError(422, f"Invalid LFS object: {obj!r}")
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not (store.blob(oid).exists() and store.blob(oid).stat().st_size == size):
                # A pre-signed URL, like the Hub's S3 ones: the PUT itself carries no Authorization.
                sig = hmac.new(self.server.secret, f"{oid}:{size}:{expires}".encode(), "sha256").hexdigest()
                href = f"{self.server.url}/lfs-upload/{oid}?size={size}&expires={expires}&sig={sig}"
                entry["actions"] = {"upload": {"href": href, "header": {}, "expires_in": 3600}}
            objects.append(entry)
        self._send(
            200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, ctype="application/vnd.git-lfs+json"
        )

    def _h_lfs_put(self, oid: str) -> None:
        size, expires, sig = (self.query.get(key, "") for key in ("size", "expires", "sig"))
        expected = hmac.new(self.server.secret, f"{oid}:{size}:{expires}".encode(), "sha256").hexdigest()
        if not (sig.isascii() and hmac.compare_digest(sig, expected)) or int(expires) < time.time():
            raise HubError(403, "Upload URL signature is invalid or expired", "SignatureDoesNotMatch")
        store, digest = self.server.store, hashlib.sha256()
        tmp = store.root / "tmp" / uuid.uuid4().hex
        try:
            with tmp.open("wb") as f:
                for chunk in self._body_chunks():  # streamed: weights can be GiBs
                    digest.update(chunk)
                    f.write(chunk)
            if tmp.stat().st_size != int(size) or digest.hexdigest() != oid:
                raise HubError(400, f"Uploaded content does not match oid {oid} and size {size}", "BadDigest")
            os.replace(tmp, store.blob(oid))
        finally:
            tmp.unlink(missing_ok=True)
        self._send(200, b"", ctype="text/plain")

    def _h_commit(self, plural: str, namespace: str, name: str, revision: str) -> None:
        if self.query.get("create_pr"):
            raise HubError(400, "LocalHub does not support pull requests")
        rtype, repo_id, _ = self._repo(plural, namespace, name, write=True)
        fault = self.server.take_commit_fault()
        if fault == "cut":  # the connection drops mid-request: half the payload arrived, nothing is committed
            self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)
            raise _DropConnection
        try:
            lines = [json.loads(line) for line in b"".join(self._body_chunks()).splitlines() if line.strip()]
        except ValueError as err:
            raise HubError(400, f"Malformed NDJSON commit payload: {err}") from None
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header, store = lines[0]["value"], self.server.store
        with store.lock:
            state = store.load(rtype, repo_id)  # re-read under the lock: concurrent commits serialise
            assert state is not None
            if revision not in state["refs"]:
                raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
            parent = state["refs"][revision]
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(state["commits"][parent]["files"])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = _check_repo_path(value.get("path"))
                if key == "file":
                    content = value.get("content", "")
                    data = base64.b64decode(content) if value.get("encoding") == "base64" else str(content).encode()
                    files[path] = {
                        "sha256": store.put_bytes(data),
                        "size": len(data),
                        "oid": _git_oid(data),
                        "lfs": False,
                    }
                elif key == "lfsFile":
                    oid, size = str(value.get("oid")), value.get("size")
                    blob = store.blob(oid)
                    if not _SHA256.fullmatch(oid) or not blob.exists() or blob.stat().st_size != size:
                        raise HubError(422, f"LFS object {oid} for {path} was not uploaded", "LfsObjectMissing")
                    files[path] = {"sha256": oid, "size": size, "oid": _git_oid(_lfs_pointer(oid, size)), "lfs": True}
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                elif key == "deletedFolder":
                    files = {p: f for p, f in files.items() if not p.startswith(path.rstrip("/") + "/")}
                else:
                    raise HubError(400, f"Unsupported commit operation: {key!r}")
            commit_id = hashlib.sha1(json.dumps([parent, files, uuid.uuid4().hex]).encode()).hexdigest()
            state["commits"][commit_id] = {
                "parents": [parent],
                "title": header.get("summary") or "",
                "message": header.get("description") or "",
                "author": namespace,
                "date": _now(),
                "files": files,
            }
            state["refs"][revision] = commit_id
            store.save(rtype, repo_id, state)
        if fault == "lost":  # committed, but the answer never reaches the client
            raise _DropConnection
        self._send(
            200,
            {
                "success": True,
                "commitOid": commit_id,
                "hookOutput": "",
                "commitUrl": f"{self._repo_url(rtype, repo_id)}/commit/{commit_id}",
            },
        )

    def _h_tree(self, plural: str, namespace: str, name: str, revision: str, sub: str | None) -> None:
        _, _, state = self._repo(plural, namespace, name, write=False)
        files = state["commits"][self._revision(state, revision)]["files"]
        prefix = _check_repo_path(sub.strip("/")) + "/" if sub and sub.strip("/") else ""
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        entries: dict[str, dict[str, Any]] = {}
        for path, f in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                entries.setdefault(
                    folder,
                    {"type": "directory", "path": folder, "size": 0, "oid": hashlib.sha1(folder.encode()).hexdigest()},
                )
            if recursive or len(parts) == 1:
                lfs = {"lfs": {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}} if f["lfs"] else {}
                entries[path] = {"type": "file", "path": path, "size": f["size"], "oid": f["oid"], **lfs}
        if prefix and not entries:
            raise HubError(404, f"{sub} does not exist on {revision}", "EntryNotFound")
        self._send(200, sorted(entries.values(), key=lambda entry: entry["path"]))

    def _h_commits(self, plural: str, namespace: str, name: str, revision: str) -> None:
        _, _, state = self._repo(plural, namespace, name, write=False)
        history, sha = [], self._revision(state, revision)
        while sha is not None:  # first-parent history, newest first
            c = state["commits"][sha]
            history.append(
                {
                    "id": sha,
                    "title": c["title"],
                    "message": c["message"],
                    "date": c["date"],
                    "authors": [{"user": c["author"]}],
                }
            )
            sha = c["parents"][0] if c["parents"] else None
        self._send(200, history)

    def _h_refs(self, plural: str, namespace: str, name: str) -> None:
        _, _, state = self._repo(plural, namespace, name, write=False)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha} for b, sha in state["refs"].items()]
        self._send(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _h_resolve(self, plural: str | None, namespace: str, name: str, revision: str, path: str) -> None:
        _, _, state = self._repo(plural, namespace, name, write=False)
        sha = self._revision(state, revision)
        f = state["commits"][sha]["files"].get(_check_repo_path(path))
        if f is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": sha})
        size = f["size"]
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{f["sha256"] if f["lfs"] else f["oid"]}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if f["lfs"]:  # what the Hub sends alongside its CDN redirect for LFS files
            headers |= {"X-Linked-Etag": f'"{f["sha256"]}"', "X-Linked-Size": str(size)}
        start, end, status = 0, size - 1, 200
        if (rng := self.headers.get("Range")) and self.command == "GET":
            if m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip()):  # the form the client sends to resume
                start, end = int(m.group(1)), min(int(m.group(2) or end), end)
            if not m or start > end:
                raise HubError(416, f"Range not satisfiable: {rng}", headers={"Content-Range": f"bytes */{size}"})
            status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
        self.send_response(status)
        for key, value in (headers | {"Content-Length": str(end - start + 1)}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            with self.server.store.blob(f["sha256"]).open("rb") as blob:
                blob.seek(start)
                remaining = end - start + 1
                while remaining > 0 and (chunk := blob.read(min(remaining, 1 << 20))):
                    self.wfile.write(chunk)
                    remaining -= len(chunk)


class LocalHub:
    """A Hub stand-in on ``127.0.0.1:<port>`` (default a free one), served from a daemon thread.

    ``users`` maps bearer tokens to user names (the first pair is ``token``/``user``). Writes need a
    valid token and may go only to the caller's own namespace. Use it as a context manager, or call
    ``start()`` and ``close()``.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        users: Mapping[str, str] = DEFAULT_USERS,
        max_body_bytes: int = MAX_BODY_BYTES,
        port: int = 0,
    ) -> None:
        if not users:
            raise ValueError("LocalHub needs at least one token -> user entry")
        self.root = Path(root)
        self.token, self.user = next(iter(users.items()))
        self._server = _Server(_Store(self.root), users, max_body_bytes, port)
        # A short poll interval keeps close() (which waits for the serve loop to notice) quick.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="LocalHub", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, to pass as ``endpoint=`` to huggingface_hub."""
        return self._server.url

    def fail_next_commit(self, *, committed: bool = False) -> None:
        """Make the next commit request fail once, as a connection dropped by the server: it reads
        half the request body and closes the socket without an answer, so nothing is committed;
        with ``committed``, it reads the whole request, commits, and then closes the socket without
        an answer, so the client cannot tell the commit happened. Calls queue up, one per request."""
        with self._server.store.lock:
            self._server.commit_faults.append("lost" if committed else "cut")

    @property
    def dropped_commits(self) -> int:
        """How many commit requests were failed on purpose so far."""
        return self._server.dropped_commits

    def start(self) -> LocalHub:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
