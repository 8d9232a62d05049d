"""Read a kernel's resource usage from the cubin (ELF) itself.

The ptxas `-v` log is not always there: with a driver present, NVRTC serves repeat compiles from the driver's
compute cache and skips ptxas, leaving the log empty. The cubin always carries the facts:
- `.nv.info` holds per-symbol attributes: REGCOUNT (0x2f) and FRAME_SIZE (0x11), each as (symbol index, value);
- `.nv.shared.<entry>` is the static shared memory plus the 1 KB the system reserves per block (measured:
  32 -> 1056 and 4000 -> 5024 bytes) when a `.nv.shared.reserved.*` section is present.
"""
from __future__ import annotations

import struct

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_SHT_SYMTAB = 2
_RESERVED_SMEM = 1024


def _sections(b: bytes):
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]
    out = {}
    for name_off, typ, _f, _a, off, size, link, _i, _al, entsize in raw:
        end = b.index(b"\0", strtab + name_off)
        out[b[strtab + name_off:end].decode()] = (typ, off, size, link, entsize)
    return out, raw


def _symbol_index(b: bytes, secs, raw, name: str) -> int:
    for typ, off, size, link, entsize in secs.values():
        if typ != _SHT_SYMTAB:
            continue
        names = raw[link][4]
        for i in range(size // entsize):
            st_name, = struct.unpack_from("<I", b, off + i * entsize)
            end = b.index(b"\0", names + st_name)
            if b[names + st_name:end].decode() == name:
                return i
    raise KeyError(f"symbol {name!r} not in cubin")


def _attributes(b: bytes, off: int, size: int):
    """Yield (attribute, payload bytes) from an .nv.info section."""
    i = off
    while i < off + size:
        fmt, attr = b[i], b[i + 1]
        if fmt == 4:  # sized value
            n, = struct.unpack_from("<H", b, i + 2)
            yield attr, b[i + 4:i + 4 + n]
            i += 4 + n
        elif fmt == 3:  # 16-bit value
            yield attr, b[i + 2:i + 4]
            i += 4
        elif fmt == 2:  # 8-bit value
            yield attr, b[i + 2:i + 3]
            i += 3
        elif fmt == 1:  # flag
            yield attr, b""
            i += 2
        else:
            return


def resources(cubin: bytes, entry: str) -> dict:
    """{'registers', 'stack_bytes', 'static_smem'} of `entry`, read from the cubin."""
    secs, raw = _sections(cubin)
    sym = _symbol_index(cubin, secs, raw, entry)
    regs = frame = None
    info = secs.get(".nv.info")
    if info:
        for attr, payload in _attributes(cubin, info[1], info[2]):
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(payload) == 8:
                idx, value = struct.unpack("<II", payload)
                if idx == sym:
                    if attr == _EIATTR_REGCOUNT:
                        regs = value
                    else:
                        frame = value
    if regs is None:
        raise ValueError(f"no register count for {entry!r} in the cubin")
    shared = secs.get(f".nv.shared.{entry}")
    smem = 0
    if shared:
        reserved = any(n.startswith(".nv.shared.reserved") for n in secs)
        smem = max(0, shared[2] - (_RESERVED_SMEM if reserved else 0))
    return {"registers": regs, "stack_bytes": frame or 0, "static_smem": smem}


def nvdisasm_path() -> str | None:
    """nvdisasm from the `nvidia-cuda-nvdisasm` wheel (test extra) or the PATH, if present."""
    import importlib.util
    import shutil
    from pathlib import Path

    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations if spec else []):
        for cand in sorted(Path(loc).glob("*/bin/nvdisasm")):
            return str(cand)
    return shutil.which("nvdisasm")


def sass(cubin: bytes) -> str:
    """Disassemble a cubin (no GPU needed). Raises FileNotFoundError when nvdisasm is not installed."""
    import subprocess
    import tempfile

    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True)
    return out.stdout
