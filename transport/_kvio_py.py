"""Pure-Python twin of ``transport._kvio`` (same functions, same arguments, same errors).

Used when the C extension is not built or ``PDR_TRANSPORT_PURE=1``. System calls go through
``ctypes`` (which releases the GIL around each foreign call) and ``os.readv``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import time
from array import array

_U64 = 1 << 64
_BATCH = 1024  # IOV_MAX on Linux

_libc = ctypes.CDLL(None, use_errno=True)


class _iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_vm_sig = [ctypes.c_int, ctypes.POINTER(_iovec), ctypes.c_ulong, ctypes.POINTER(_iovec),
           ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_writev.argtypes = _vm_sig
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = _vm_sig
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def _u64(obj, what: str) -> memoryview:
    try:
        m = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what}: a bytes-like object is required") from None
    if not m.c_contiguous or m.nbytes % 8 or m.itemsize not in (1, 8):
        raise ValueError(f"{what}: expected a buffer of uint64")
    if m.nbytes == 0:  # memoryview cannot cast a view with a zero in its shape
        return memoryview(b"").cast("Q")
    return m.cast("B").cast("Q")


def _descs(obj) -> memoryview:
    m = _u64(obj, "descriptors")
    if len(m) % 3:
        raise ValueError("descriptors: length is not a multiple of 3")
    return m


def build_descriptors(src_bases, dst_bases, src_block_bytes, dst_block_bytes, src_ids, dst_ids,
                      nbytes=-1, src_stride=0, dst_stride=0):
    sb, db = _u64(src_bases, "src_bases"), _u64(dst_bases, "dst_bases")
    si, di = _u64(src_ids, "src_ids"), _u64(dst_ids, "dst_ids")
    sbb, dbb = int(src_block_bytes), int(dst_block_bytes)
    if min(sbb, dbb, src_stride, dst_stride) < 0 or max(sbb, dbb, src_stride, dst_stride) >= _U64:
        raise OverflowError("block bytes and strides must fit in uint64")
    if len(sb) != len(db):
        raise ValueError("src_bases and dst_bases differ in length")
    if sbb == 0 or dbb == 0:
        raise ValueError("block bytes must be > 0")
    sst, dst = src_stride or sbb, dst_stride or dbb
    if sst < sbb or dst < dbb:
        raise ValueError("stride must be >= block bytes")
    total = min(len(si) * sbb, len(di) * dbb)
    if nbytes >= 0:
        if nbytes > total:
            raise ValueError("nbytes exceeds the bytes covered by the block lists")
        total = nbytes

    # 1. Offsets relative to a layer's base: walk both block lists together, merge runs.
    rs: list[int] = []
    rd: list[int] = []
    rl: list[int] = []
    i = j = so = do = 0
    left = total
    while left:
        n = min(sbb - so, dbb - do, left)
        s = si[i] * sst + so
        d = di[j] * dst + do
        if s >= _U64 or d >= _U64:
            raise OverflowError("block id * stride overflows 64 bits")
        if rl and rs[-1] + rl[-1] == s and rd[-1] + rl[-1] == d:
            rl[-1] += n
        else:
            rs.append(s)
            rd.append(d)
            rl.append(n)
        left -= n
        so += n
        do += n
        if so == sbb:
            so, i = 0, i + 1
        if do == dbb:
            do, j = 0, j + 1

    # 2. Per layer: add the bases; merge across a layer boundary only where contiguous.
    out = array("Q")
    rel = list(zip(rs, rd, rl))
    for bs, bd in zip(sb, db):
        for s, d, n in rel:
            s += bs
            d += bd
            if s + n >= _U64 or d + n >= _U64:
                raise OverflowError("base + offset overflows 64 bits")
            if out and out[-3] + out[-1] == s and out[-2] + out[-1] == d:
                out[-1] += n
            else:
                out.extend((s, d, n))
    return bytearray(out.tobytes())


def copy_batch(descs) -> int:
    m = _descs(descs)
    total = 0
    memmove = ctypes.memmove
    for r in range(0, len(m), 3):
        n = m[r + 2]
        memmove(m[r + 1], m[r], n)
        total += n
    return total


def _rows(m: memoryview, row: int, off: int):
    """Yield (row, off, src, dst, len) of the unsent rest from the cursor, at most _BATCH rows."""
    k = 0
    while row < len(m) // 3 and k < _BATCH:
        n = m[3 * row + 2] - off
        if n:
            yield m[3 * row] + off, m[3 * row + 1] + off, n
            k += 1
        row, off = row + 1, 0


def _advance(m: memoryview, row: int, off: int, n: int) -> tuple[int, int]:
    while row < len(m) // 3:
        rest = m[3 * row + 2] - off
        if n < rest:
            return row, off + n
        n -= rest
        row, off = row + 1, 0
    return row, off


def _merged(batch, col: int) -> list[tuple[int, int]]:
    """One side's (base, len) iovecs for a batch, runs contiguous on that side merged (as the C
    does; the two sides are cut independently)."""
    out: list[list[int]] = []
    for row in batch:
        a, n = row[col], row[2]
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += n
        else:
            out.append([a, n])
    return [tuple(x) for x in out]


def _vm_copy(pid: int, descs, write: bool) -> int:
    m = _descs(descs)
    call = _libc.process_vm_writev if write else _libc.process_vm_readv
    row = off = total = 0
    while True:
        batch = list(_rows(m, row, off))
        if not batch:
            return total
        lo, re = _merged(batch, 0 if write else 1), _merged(batch, 1 if write else 0)
        loc, rem = (_iovec * len(lo))(*lo), (_iovec * len(re))(*re)
        got = call(pid, loc, len(lo), rem, len(re), 0)
        if got < 0:
            e = ctypes.get_errno()
            if e == errno.EINTR:
                continue
            raise OSError(e, os.strerror(e))
        if got == 0:
            raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
        total += got
        row, off = _advance(m, row, off, got)


def vm_write(pid, descs) -> int:
    return _vm_copy(pid, descs, True)


def vm_read(pid, descs) -> int:
    return _vm_copy(pid, descs, False)


def _sock_iov(fd: int, descs, col: int, timeout_ms: int, sending: bool) -> int:
    if col not in (0, 1):
        raise ValueError("col must be 0 or 1")
    m = _descs(descs)
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
    row = off = total = 0
    while True:
        bufs = [(ctypes.c_char * n).from_address(a if col == 0 else b) for a, b, n in _rows(m, row, off)]
        if not bufs:
            return total
        try:
            n = os.writev(fd, bufs) if sending else os.readv(fd, bufs)
        except (BlockingIOError, InterruptedError) as e:
            if isinstance(e, InterruptedError):
                continue
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)) from None
            p = select.poll()
            p.register(fd, select.POLLOUT if sending else select.POLLIN)
            if not p.poll(None if wait is None else max(1, int(wait * 1000))):
                raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)) from None
            continue
        if n == 0 and not sending:
            return total
        total += n
        row, off = _advance(m, row, off, n)
        if deadline is not None and row < len(m) // 3 and time.monotonic() > deadline:
            raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))


def send_iov(fd, descs, col, timeout_ms) -> int:
    return _sock_iov(fd, descs, col, timeout_ms, True)


def recv_iov(fd, descs, col, timeout_ms) -> int:
    return _sock_iov(fd, descs, col, timeout_ms, False)
