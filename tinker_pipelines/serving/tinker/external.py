"""Weights out through the API: `save_weights_external` and `get_external_weights_urls`.

`save_weights_external(name)` writes the training client's adapter, as it is at that point of its
`seq_id` order, as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`,
`base_model_name_or_path` the service's base name: what `PeftModel.from_pretrained` and vLLM's
`--lora-modules` load) under `home/checkpoints/<model_id>/external_weights/<name>`, addressed
`tinker://<model_id>/external_weights/<name>`. It is a checkpoint like the others (listed with
`checkpoint_type` "external", TTL, publish, delete); its `record.json` is the service's own
(hashes, LoRA shape: the service can sample it) and is not offered for download.

`get_external_weights_urls` answers one URL per file, under `guard.SIGNED_PREFIX`, which needs
no API key: each carries an HMAC-SHA256 signature (a secret kept in `home/external.key`, mode
0600) over the checkpoint, the file, an expiry, the save it was issued for and whether it was
issued to the owner or through publication. A download is refused when the URL was changed
(403), has expired (410), its checkpoint was deleted, expired or saved anew under the name
(404), or it was issued through publication that has since been withdrawn (403). The URLs'
host is the one the client used to ask for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import quote, urlencode

from tinker import types

from tinker_pipelines.checkpoint import atomic_directory, write_record
from tinker_pipelines.serving.export import vllm_format_problems, write_peft_adapter
from tinker_pipelines.serving.tinker import catalog, tenancy
from tinker_pipelines.serving.tinker.guard import SIGNED_PREFIX
from tinker_pipelines.serving.tinker.service import Gone, Invalid, Model, NotFound, Service, check_name, now_iso

KIND = "external_weights"
"""The checkpoint kind, the second part of the `tinker://` path."""
KEY_FILE = "external.key"
"""The signing secret's file in the service's home (hex, created once, mode 0600)."""
URL_TTL_S = 3600
"""How long a signed URL is good for (never past its checkpoint's own expiry)."""
SERVICE_ONLY = frozenset({"record.json"})
"""Files of the directory that are the service's, not the export's: never given a URL."""
SCOPES = ("owner", "public")
"""Whom a URL was issued to: the checkpoint's owner, or another key through publication."""


class Forbidden(PermissionError):
    """A download URL this service did not sign as it stands, or whose grant was withdrawn (403)."""

    status = 403

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def load_secret(path: Path) -> bytes:
    """The signing secret in `path`, made (32 random bytes, hex, mode 0600) if there is none.
    Linked into place whole, so a second process starting on the same home reads the same one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 32:
        raise ValueError(f"{path}: the external weights signing key must be at least 64 hex digits; delete the file "
                         "to have a new one made (URLs already issued then stop working)")
    return key


def _version(entry: dict[str, Any]) -> str:
    """Which save of the checkpoint a URL is for: a delete and a new save under the name change it."""
    return hashlib.sha256(str(entry.get("time")).encode()).hexdigest()[:16]


def _epoch(iso: str | None) -> float | None:
    return None if not iso else datetime.fromisoformat(str(iso)).timestamp()


def served_files(d: Path) -> list[str]:
    """The files of export directory `d` a client downloads, as paths relative to it."""
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                  if p.is_file() and p.name not in SERVICE_ONLY and not p.name.startswith("."))


def _write_export(src: Path, d: Path, base_name: str, saved: dict[str, Any]) -> None:
    """`d`, atomically: the PEFT adapter of checkpoint `src` (which `Runtime.save` wrote) and a
    record that keeps what the worker needs to host it read-only (mode, LoRA shape, base)."""
    with atomic_directory(d) as tmp:
        write_peft_adapter(tmp, src, base_name)
        kept = {k: saved[k] for k in ("mode", "base_model", "learner", "learner_steps", "tinker") if k in saved}
        write_record(tmp, {**kept, "format": "peft", "source_content_hash": saved.get("content_hash"),
                           "vllm_format_problems": vllm_format_problems(tmp)})


class External:
    """The export, URL signing and download checks of one service home."""

    def __init__(self, home: Path, url_ttl_s: int = URL_TTL_S):
        self.home = Path(home)
        self.url_ttl_s = url_ttl_s
        self._key = load_secret(self.home / KEY_FILE)

    @classmethod
    def open(cls, home: Path, url_ttl_s: int = URL_TTL_S) -> External:
        """The service's, at its start: what a save cut short by a kill left behind is removed
        (hidden directories beside the exports; no save is in flight yet)."""
        for d in Path(home).glob(f"checkpoints/*/{KIND}/.*"):
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
        return cls(home, url_ttl_s)

    # -- save --------------------------------------------------------------------------------
    def save(self, svc: Service, req: types.SaveWeightsExternalRequest) -> str:
        """Queue the export as call `seq_id` of the client; the request id (its result:
        `SaveWeightsExternalResponseInternal`)."""
        name = req.path
        path = f"tinker://{req.model_id}/{KIND}/{name}"

        def check() -> None:
            check_name(name, "path")
            svc._ttl(req.ttl_seconds)
            if req.age_encryption_recipients:
                raise Invalid("age_encryption_recipients: this service does not encrypt exports; leave it out (the "
                              "files are served only through signed, expiring URLs given to the checkpoint's owner, "
                              "or to every key once it is published)", "age_encryption_recipients")

        async def work(m: Model) -> dict[str, Any]:
            entry = await self._write(svc, m, name, path, req.ttl_seconds)
            return types.SaveWeightsExternalResponseInternal(path=path, size_bytes=entry["size_bytes"],
                                                             type="save_weights_external").model_dump(mode="json")
        return svc._ordered(req.model_id, req.seq_id, work, check)

    async def _write(self, svc: Service, m: Model, name: str, path: str, ttl_seconds: int | None) -> dict[str, Any]:
        d = svc.checkpoint_dir(m.model_id, KIND, name)
        if d.exists():
            raise Invalid(f"checkpoint {path} exists; save under another name, or delete it first", "path")
        # the worker writes our own checkpoint format from the live adapter; the export is made from it
        src = d.parent / f".{name}.src-{secrets.token_hex(4)}"
        record = {"tinker": {**m.meta(), "path": path, "kind": KIND, "name": name, "saved_at": now_iso()}}
        try:
            saved = await asyncio.to_thread(svc.runtime.save, m.trainer, src, record)
            await asyncio.to_thread(_write_export, src, d, m.base_model, saved)
        finally:
            await asyncio.to_thread(shutil.rmtree, src, True)
        entry = {"checkpoint_id": f"{KIND}/{name}", "checkpoint_type": "external", "time": now_iso(),
                 "tinker_path": path, "size_bytes": sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                 "public": False, "expires_at": catalog.expiry(ttl_seconds)}
        m.saved[entry["checkpoint_id"]] = entry
        svc._save_meta(m)
        return entry

    # -- URLs --------------------------------------------------------------------------------
    def urls(self, svc: Service, model_id: str, checkpoint_id: str, base_url: str) -> types.ExternalWeightsUrlsResponse:
        """Signed URLs of every file of the caller's (or a published) external checkpoint, on
        `base_url` (the service's root as the client reached it)."""
        kind, _, name = checkpoint_id.partition("/")
        if kind != KIND:
            raise Invalid(f"checkpoint_id {checkpoint_id!r} is not an external weights checkpoint: only "
                          f"tinker://RUN/{KIND}/NAME (save_weights_external) has download URLs", "checkpoint_id")
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        d = svc.resolve(tinker_path, "checkpoint_id")[3]  # owned or published, not expired: else 404
        meta = svc.models[model_id].meta() if model_id in svc.models else catalog.read_run(self.home, model_id)
        entry = ((meta or {}).get("checkpoints") or {}).get(checkpoint_id)
        if entry is None:  # its files, without its listing entry: a delete that was cut short
            raise NotFound(f"checkpoint_id {tinker_path!r}: no such checkpoint on this service", "checkpoint_id")
        scope = "owner" if meta.get("owner", tenancy.LOCAL) == tenancy.current() else "public"
        expires = int(time.time()) + self.url_ttl_s
        ends = _epoch(entry.get("expires_at"))
        if ends is not None:
            expires = min(expires, int(ends))
        root = base_url.rstrip("/") + SIGNED_PREFIX
        urls = {f: root + self.url_path(model_id, name, f, expires, scope, _version(entry)) for f in served_files(d)}
        return types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc))

    def signature(self, model_id: str, name: str, file: str, expires: int, scope: str, version: str) -> str:
        # a JSON list: no choice of fields can make two different URLs sign the same bytes
        message = json.dumps([model_id, name, file, int(expires), scope, version]).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def url_path(self, model_id: str, name: str, file: str, expires: int, scope: str, version: str) -> str:
        """The part of a signed URL after `SIGNED_PREFIX`."""
        query = {"expires": int(expires), "scope": scope, "v": version,
                 "signature": self.signature(model_id, name, file, expires, scope, version)}
        return f"{quote(model_id, safe='')}/{quote(name, safe='')}/{quote(file)}?{urlencode(query)}"

    # -- download ----------------------------------------------------------------------------
    def file(self, model_id: str, name: str, file: str, query: Mapping[str, str]) -> Path:
        """The file a signed URL names, after its checks (the module's doc says which answer which)."""
        expires, scope, version, given = (query.get(k, "") for k in ("expires", "scope", "v", "signature"))
        if not (expires.isdigit() and scope in SCOPES and version and given):
            raise Forbidden("this URL is not a signed external weights URL (expires, scope, v and signature are "
                            "required); get one with get_external_weights_urls", "signature")
        want = self.signature(model_id, name, file, int(expires), scope, version)
        if not hmac.compare_digest(want, given):
            raise Forbidden("the URL's signature does not match it: it was changed, or not issued by this service",
                            "signature")
        if time.time() > int(expires):
            raise Gone(f"this URL expired at {datetime.fromtimestamp(int(expires), timezone.utc).isoformat()}; get "
                       "new ones with get_external_weights_urls", "expires")
        meta = catalog.read_run(self.home, model_id) or {}
        entry = (meta.get("checkpoints") or {}).get(f"{KIND}/{name}")
        if entry is None or catalog.is_expired(entry) or _version(entry) != version:
            raise NotFound(f"checkpoint tinker://{model_id}/{KIND}/{name} no longer exists as this URL was issued for "
                           "(deleted, expired, or saved anew)", "checkpoint_id")
        if scope == "public" and not entry.get("public"):
            raise Forbidden(f"checkpoint tinker://{model_id}/{KIND}/{name} is no longer published", "checkpoint_id")
        d = (self.home / "checkpoints" / model_id / KIND / name).resolve()
        parts = file.split("/")
        target = (d / file).resolve()
        if (any(p in ("", ".", "..") or p.startswith(".") for p in parts) or file.startswith("/")
                or parts[-1] in SERVICE_ONLY or d not in target.parents or not target.is_file()):
            raise NotFound(f"file {file!r} is not part of tinker://{model_id}/{KIND}/{name}", "file")
        return target
