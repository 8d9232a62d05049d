"""NVRTC compilation of ptx/ sources into cubins, with an on-disk cache that is safe under concurrent writers.

Cache entry layout: MAGIC | u64 len(meta) | u64 len(cubin) | sha256(meta + cubin) | meta (JSON) | cubin.
An entry that fails any of these checks is deleted and rebuilt, never loaded. The cache is an optimisation, never a
failure: a cache directory that cannot be created, read or written (read-only, not a directory, full) logs one warning
and the kernels are compiled and kept in memory.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cuda.bindings import nvrtc

from .cubin import resources

log = logging.getLogger("cudart_kernels")

_MAGIC = b"CKCUBIN1"
_HEADER = struct.Struct("<8sQQ32s")


def ptx_dir() -> Path:
    """The kernel sources: `cudart_kernels/_ptx` in an installed wheel, `ptx/` beside the package in a source tree."""
    here = Path(__file__).resolve().parent.parent
    for cand in (here / "_ptx", here.parent / "ptx"):
        if (cand / "common").is_dir():
            return cand
    raise FileNotFoundError(f"kernel sources not found beside {here}")


def cache_dir() -> Path:
    env = os.environ.get("CUDART_KERNELS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cudart-kernels"


def nvrtc_version() -> tuple[int, int]:
    err, major, minor = nvrtc.nvrtcVersion()
    if err:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return major, minor


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class CompileReport:
    """Resource usage of the entry function. Registers, stack frame and static smem come from the cubin (always
    present); spill counts from ptxas' `-v` log, which is empty when NVRTC served the compile from the driver's
    cache (then `spills_known` is False; spills need a stack frame, so `stack_bytes == 0` still proves none)."""
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem: int
    spills_known: bool = True
    log: str = field(default="", repr=False)

    @property
    def wgmma_serialized(self) -> bool:
        """ptxas made every wgmma wait for the previous one (warnings C7514, C7517, C7520: accumulators it could
        not prove idle, or a compiler-inserted warpgroup arrive on a divergent path; a silent, large slowdown)."""
        return "wgmma.mma_async instructions are serialized" in self.log

    @staticmethod
    def parse(text: str, entry: str, cubin: bytes | None = None) -> "CompileReport":
        lines = text.splitlines()
        start = next((i for i, l in enumerate(lines) if f"entry function '{entry}'" in l), None)
        block = ""
        if start is not None:
            end = next((i for i in range(start + 1, len(lines)) if "Compiling entry function" in lines[i]), len(lines))
            block = "\n".join(lines[start:end])

        def num(pattern):
            m = re.search(pattern, block)
            return int(m.group(1)) if m else 0

        known = "bytes spill stores" in block
        if cubin is not None:
            res = resources(cubin, entry)
        else:
            res = {"registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
                   "static_smem": num(r"(\d+) bytes smem")}
        return CompileReport(spill_stores=num(r"(\d+) bytes spill stores"),
                             spill_loads=num(r"(\d+) bytes spill loads"), spills_known=known, log=text, **res)


@dataclass(frozen=True)
class Compiled:
    name: str        # kernel family, e.g. "quantize"
    entry: str       # extern "C" symbol
    defines: tuple   # ((name, value), ...) sorted
    arch: str
    key: str         # cache key (hex)
    cubin: bytes
    report: CompileReport
    seconds: float   # time of the original compile
    from_disk: bool  # True when this process read it from the cache


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _source_closure(path: Path, root: Path, seen: dict) -> None:
    """Collect `path` and every file it includes with quotes (relative to itself or to `root`)."""
    if path in seen:
        return
    text = path.read_text()
    seen[path] = text
    for inc in _INCLUDE.findall(text):
        for base in (path.parent, root):
            cand = (base / inc).resolve()
            if cand.is_file():
                _source_closure(cand, root, seen)
                break
        else:
            raise CompileError(f"{path.name}: include {inc!r} not found")


def _options(arch: str, defines: tuple, root: Path) -> list[str]:
    opts = [f"-arch={arch}", "-std=c++17", "--ptxas-options=-v", "-lineinfo", f"-I{root}"]
    opts += [f"-D{k}={v}" for k, v in defines]
    return opts


def _cache_key(source: str, entry: str, defines: tuple, arch: str) -> tuple[str, Path, list[str], str]:
    from .. import __version__

    root = ptx_dir()
    path = (root / source).resolve()
    files: dict = {}
    _source_closure(path, root, files)
    opts = _options(arch, defines, root)
    h = hashlib.sha256()
    for part in (__version__, str(nvrtc_version()), entry, json.dumps([o for o in opts if not o.startswith("-I")])):
        h.update(part.encode() + b"\0")
    for p in sorted(files, key=lambda p: p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)):
        h.update(p.name.encode() + b"\0" + files[p].encode() + b"\0")
    return h.hexdigest(), path, opts, files[path]


_cache_warned: set = set()


def _cache_unusable(path: Path, what: str, err: OSError) -> None:
    """One warning per cache directory and process: the run goes on from memory."""
    if path.parent not in _cache_warned:
        _cache_warned.add(path.parent)
        log.warning("cudart_kernels: cannot %s the kernel cache in %s (%s); compiled kernels are kept in memory only "
                    "(set CUDART_KERNELS_CACHE_DIR to a writable directory)", what, path.parent, err)


@contextlib.contextmanager
def entry_lock(path: Path):
    """An exclusive lock on a cache entry while it is made (a compiled kernel; the device's measured copy rate,
    driver.stream_rate), so that processes sharing a cache make each once (the others wait and then read the
    entry). Without a usable cache directory: no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _read_entry(path: Path):
    """Return (meta, cubin) from a cache file, or None if it is missing, unreadable, truncated or corrupt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _cache_unusable(path, "read", e)
        return None
    if len(data) < _HEADER.size:
        return None
    magic, n_meta, n_cubin, digest = _HEADER.unpack_from(data)
    body = data[_HEADER.size:]
    if magic != _MAGIC or len(body) != n_meta + n_cubin or hashlib.sha256(body).digest() != digest:
        return None
    try:
        meta = json.loads(body[:n_meta])
    except ValueError:
        return None
    return meta, body[n_meta:]


def _write_entry(path: Path, meta: dict, cubin: bytes) -> None:
    """Atomic: write a private temp file in the same directory, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    m = json.dumps(meta).encode()
    blob = _HEADER.pack(_MAGIC, len(m), len(cubin), hashlib.sha256(m + cubin).digest()) + m + cubin
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _nvrtc_compile(text: str, filename: str, opts: list[str]) -> tuple[bytes, str]:
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), filename.encode(), 0, [], [])
    if err:
        raise CompileError(f"nvrtcCreateProgram: {err}")
    try:
        bopts = [o.encode() for o in opts]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        # Output buffers must be private and mutable: `b" " * n` is CPython's shared one-byte object when n == 1
        # (an empty log), and NVRTC writing into it corrupts every later b" " in the process.
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        text_log = bytes(buf).rstrip(b"\0 ").decode(errors="replace")
        if cerr:
            raise CompileError(f"NVRTC failed to compile {filename} ({' '.join(opts)}):\n{text_log}")
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(n)
        (gerr,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if gerr:
            raise CompileError(f"nvrtcGetCUBIN: {gerr}")
        return bytes(cubin), text_log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_memo: dict = {}


def compile_kernel(source: str, entry: str, defines: dict | None = None, arch: str = "sm_90a",
                   name: str | None = None) -> Compiled:
    """Compile `ptx/<source>` for `arch` with `-D` defines, or take it from the memory/disk cache."""
    dkey = tuple(sorted((str(k), str(v)) for k, v in (defines or {}).items()))
    memo_key = (source, entry, dkey, arch)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    key, path, opts, text = _cache_key(source, entry, dkey, arch)
    fname = cache_dir() / f"{entry}-{key[:32]}.cubin"
    name = name or Path(source).stem
    entry_data = _read_entry(fname)
    if entry_data is None:
        with entry_lock(fname):
            entry_data = _read_entry(fname)  # (another process may have compiled it while this one waited)
            if entry_data is None:
                meta, cubin = _compile_entry(fname, name, entry, dkey, arch, path, opts, text)
    if entry_data is None:
        from_disk = False
    else:
        meta, cubin = entry_data
        from_disk = True
    out = Compiled(name=name, entry=entry, defines=dkey, arch=arch, key=key, cubin=cubin,
                   report=CompileReport.parse(meta["log"], entry, cubin), seconds=meta["seconds"], from_disk=from_disk)
    _memo[memo_key] = out
    return out


def _compile_entry(fname: Path, name: str, entry: str, dkey: tuple, arch: str, path, opts, text):
    """NVRTC on a cache miss; the entry is written to the disk cache when it can be. Returns (meta, cubin)."""
    if fname.is_file():
        log.warning("cudart_kernels: cache entry %s is corrupt; rebuilding", fname.name)
        try:
            fname.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            _cache_unusable(fname, "delete a corrupt entry in", e)
    t0 = time.perf_counter()
    cubin, text_log = _nvrtc_compile(text, str(path), opts)
    secs = time.perf_counter() - t0
    meta = {"name": name, "entry": entry, "defines": dkey, "arch": arch, "log": text_log, "seconds": secs}
    try:
        _write_entry(fname, meta, cubin)
    except OSError as e:
        _cache_unusable(fname, "write", e)
    log.info("cudart_kernels: compiled %s %s for %s in %.2f s", entry, dict(dkey), arch, secs)
    return meta, cubin


def cache_size() -> tuple[int, int]:
    """(number of entries, bytes) in the disk cache."""
    d = cache_dir()
    if not d.is_dir():
        return 0, 0
    files = [p for p in d.glob("*.cubin")]
    return len(files), sum(p.stat().st_size for p in files)


def clear_memory_cache() -> None:
    _memo.clear()
