"""A job's context from Python (Client.submit(context=DIR)): the folder packed as yard packs it
(common/context_archive.h: a gzip'd ustar archive of plain files and folders, `.git` and what the
root's .gitignore and .yardignore ignore left out, at most 64 MiB of files), named by its SHA-256
and uploaded with JobService.UploadContext."""
import gzip
import hashlib
import io
import os
import re
import stat
import tarfile

MAX_BYTES = 64 << 20
MAX_ENTRIES = 100000
CHUNK = 1 << 20


def _pattern_regex(pattern):
    """git's wildcards within one name: '*' and '?' never match '/'."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def ignore_rules(text):
    """(regex, negate, folders_only, anchored) of each rule of an ignore file, in order."""
    rules = []
    for line in text.splitlines():
        p = line.rstrip()
        if not p or p.startswith("#"):
            continue
        negate = p.startswith("!")
        if negate:
            p = p[1:]
        elif p.startswith("\\!") or p.startswith("\\#"):
            p = p[1:]
        folders_only = p.endswith("/")
        p = p.rstrip("/") if folders_only else p
        while p.startswith("**/"):
            p = p[3:]
        anchored = "/" in p
        p = p.lstrip("/") if anchored else p
        if p:
            rules.append((_pattern_regex(p), negate, folders_only, anchored))
    return rules


def ignored(rules, path, folder):
    result = False
    for regex, negate, folders_only, anchored in rules:
        if folders_only and not folder:
            continue
        if regex.match(path if anchored else path.rsplit("/", 1)[-1]):
            result = not negate
    return result


def pack(folder):
    """(archive bytes, "sha256:<hex>") of `folder`; ValueError naming "context" when it is not a
    folder or holds too much."""
    root = os.path.abspath(folder)
    if not os.path.isdir(root):
        raise ValueError(f"context: {folder} is not a folder")
    rules = []
    for name in (".gitignore", ".yardignore"):
        try:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                rules += ignore_rules(f.read(1 << 20))
        except OSError:
            pass
    entries, total = [], 0

    def walk(rel):
        nonlocal total
        for name in sorted(os.listdir(os.path.join(root, rel))):
            if name == ".git":
                continue
            path = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(root, path))
            folder = stat.S_ISDIR(st.st_mode)
            if ignored(rules, path, folder) or not (folder or stat.S_ISREG(st.st_mode)):
                continue
            entries.append((path, folder, st))
            if len(entries) > MAX_ENTRIES:
                raise ValueError(f"context: {root} holds more than {MAX_ENTRIES} files and folders")
            if folder:
                walk(path)
            else:
                total += st.st_size

    walk("")
    if total > MAX_BYTES:
        largest = sorted((e for e in entries if not e[1]), key=lambda e: -e[2].st_size)[:3]
        named = ", ".join(f"{p} {s.st_size / 1048576:.1f} MiB" for p, _, s in largest)
        raise ValueError(f"context: {root} holds {total / 1048576:.1f} MiB of files, at most "
                         f"{MAX_BYTES / 1048576:.1f} MiB (largest: {named}); leave data out with "
                         "a .yardignore")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, folder, st in entries:
            info = tarfile.TarInfo(path)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if folder:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = st.st_size
                info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                with open(os.path.join(root, path), "rb") as f:
                    tar.addfile(info, f)
    archive = gzip.compress(raw.getvalue(), mtime=0)
    return archive, "sha256:" + hashlib.sha256(archive).hexdigest()


def chunks(archive, digest):
    """The UploadContext request messages of `archive` (a list: sent again whole on a retry)."""
    from trainyard.v1 import node_pb2

    out = []
    for at in range(0, max(len(archive), 1), CHUNK):
        first = at == 0
        out.append(node_pb2.ContextChunk(digest=digest if first else "",
                                         size_bytes=len(archive) if first else 0,
                                         data=archive[at:at + CHUNK]))
    return out
