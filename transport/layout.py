"""Block layouts -> transfer descriptors, and descriptor checks against registered regions.

The contract of ``build_descriptors`` (the C core and its twin implement it; see _kvio.c):

- Each side has P planes (``bases``, the same count on both sides; plane ``i`` on the source is
  copied to plane ``i`` on the destination) and a block list. Block ``b`` of plane ``i`` covers
  ``[bases[i] + b*stride, + block_bytes)``.
- Per plane, the source blocks, concatenated in list order, form one byte stream; so do the
  destination blocks. The first ``nbytes`` of the source stream are copied to the first ``nbytes``
  of the destination stream (default: the shorter of the two). So block sizes may differ between
  the sides (a 16-token block onto half of a 32-token block), and so may the list lengths. For
  vLLM this is token order when a block holds its tokens contiguously (NHD layouts); with HND
  layouts both sides must use the same block size.
- The result is an (N, 3) uint64 array of rows (src_addr, dst_addr, len), planes in order, bytes in
  stream order; adjacent pieces contiguous on both sides are merged, so N is the fewest
  descriptors that keep that order (a run reversed on one side is not merged).
- Errors: ValueError for inconsistent arguments, OverflowError for addresses past 2**64.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from transport import _core
from transport.base import BlockSpec, Region, RegionError

DESC_DTYPE = np.uint64


def _u64(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.size and a.dtype.kind == "i" and (a < 0).any():
        raise ValueError(f"{what}: negative values")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{what}: integers required, got {a.dtype}")
    return np.ascontiguousarray(a.reshape(-1), dtype=np.uint64)


def build_descriptors(src_bases: Sequence[int] | np.ndarray, dst_bases: Sequence[int] | np.ndarray,
                      src_block_bytes: int, dst_block_bytes: int,
                      src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray,
                      nbytes: int | None = None, src_stride: int = 0, dst_stride: int = 0,
                      core: ModuleType | None = None) -> np.ndarray:
    """(src, dst, len) descriptors for copying ``src_ids`` blocks onto ``dst_ids`` blocks."""
    impl = core or _core
    raw = impl.build_descriptors(
        _u64(src_bases, "src_bases"), _u64(dst_bases, "dst_bases"), int(src_block_bytes),
        int(dst_block_bytes), _u64(src_ids, "src_ids"), _u64(dst_ids, "dst_ids"),
        -1 if nbytes is None else int(nbytes), int(src_stride), int(dst_stride))
    return np.frombuffer(raw, dtype=DESC_DTYPE).reshape(-1, 3)


def descriptors_for(src: BlockSpec, dst: BlockSpec, src_ids, dst_ids, nbytes: int | None = None,
                    core: ModuleType | None = None) -> np.ndarray:
    """``build_descriptors`` for two ``BlockSpec``s."""
    return build_descriptors(src.bases, dst.bases, src.block_bytes, dst.block_bytes, src_ids,
                             dst_ids, nbytes, src.stride, dst.stride, core)


def build_descriptors_numpy(src_bases, dst_bases, src_block_bytes: int, dst_block_bytes: int,
                            src_ids, dst_ids, nbytes: int | None = None, src_stride: int = 0,
                            dst_stride: int = 0) -> np.ndarray:
    """A plain vectorised numpy version of the same contract: the benchmark's third contender and
    an independent check in the tests (no overflow checks; inputs assumed valid)."""
    sb, db = (np.asarray(x, dtype=np.uint64).reshape(-1) for x in (src_bases, dst_bases))
    si, di = (np.asarray(x, dtype=np.uint64).reshape(-1) for x in (src_ids, dst_ids))
    sbb, dbb = int(src_block_bytes), int(dst_block_bytes)
    sst, dst = np.uint64(src_stride or sbb), np.uint64(dst_stride or dbb)
    total = min(len(si) * sbb, len(di) * dbb) if nbytes is None else int(nbytes)
    if total == 0 or len(sb) == 0:
        return np.empty((0, 3), dtype=np.uint64)
    # Cut points of the stream: every block boundary of either side, then the pieces between.
    cuts = np.union1d(np.arange(0, total, sbb, dtype=np.uint64), np.arange(0, total, dbb, dtype=np.uint64))
    lens = np.diff(np.append(cuts, np.uint64(total)))
    s = si[cuts // np.uint64(sbb)] * sst + cuts % np.uint64(sbb)
    d = di[cuts // np.uint64(dbb)] * dst + cuts % np.uint64(dbb)
    # All planes at once, then merge rows contiguous with their predecessor on both sides.
    S = (sb[:, None] + s[None, :]).reshape(-1)
    D = (db[:, None] + d[None, :]).reshape(-1)
    L = np.tile(lens, len(sb))
    start = np.ones(len(S), dtype=bool)
    start[1:] = (S[:-1] + L[:-1] != S[1:]) | (D[:-1] + L[:-1] != D[1:])
    idx = np.flatnonzero(start)
    return np.stack([S[idx], D[idx], np.add.reduceat(L, idx)], axis=1)


class RegionTable:
    """Registered regions, for checking that every descriptor stays inside one of them."""

    def __init__(self, regions: Sequence[Region] = ()) -> None:
        self._regions: list[Region] = []
        self._starts = np.empty(0, dtype=np.uint64)
        self._ends = np.empty(0, dtype=np.uint64)
        for r in regions:
            self.add(r)

    def __iter__(self):
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, region: Region) -> None:
        for r in self._regions:
            if region.addr < r.end and r.addr < region.end and region != r:
                raise RegionError(f"region {region} overlaps registered {r}")
        if region in self._regions:
            return
        self._regions.append(region)
        self._regions.sort(key=lambda r: r.addr)
        self._starts = np.array([r.addr for r in self._regions], dtype=np.uint64)
        self._ends = np.array([r.end for r in self._regions], dtype=np.uint64)

    def remove(self, region: Region) -> None:
        self._regions.remove(region)
        self._starts = np.array([r.addr for r in self._regions], dtype=np.uint64)
        self._ends = np.array([r.end for r in self._regions], dtype=np.uint64)

    def index(self, addrs: np.ndarray, lens: np.ndarray, what: str) -> np.ndarray:
        """Index of the region holding each span ``[addr, addr+len)``; RegionError if any is out."""
        i = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        ok = i >= 0
        if ok.all() and len(self._regions):
            ends = addrs + lens
            ok = (ends <= self._ends[i]) & (ends >= addrs) & (lens > 0)
        elif not len(self._regions):
            ok = np.zeros(len(addrs), dtype=bool)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise RegionError(f"{what} span {int(addrs[k]):#x}+{int(lens[k])} is outside the "
                              f"registered regions")
        return i

    def check(self, descs: np.ndarray, col: int, what: str) -> np.ndarray:
        return self.index(descs[:, col], descs[:, 2], what)


def as_descs(descs) -> np.ndarray:
    """Validate a descriptor array: (N, 3) uint64, C-contiguous."""
    a = np.ascontiguousarray(descs, dtype=np.uint64)
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError(f"descriptors must be (N, 3), got shape {a.shape}")
    return a


def by_destination(descs: np.ndarray) -> np.ndarray:
    """The rows in destination-address order when no two destinations overlap (then the order
    of the copies cannot change the result), else the rows unchanged. Sorted rows let the C core
    hand ``process_vm_writev`` long runs of the peer's memory (see ``_kvio.c``: the two sides'
    iovecs are merged independently)."""
    d = as_descs(descs)
    if len(d) < 2:
        return d
    dst = d[:, 1]
    if not (dst[1:] >= dst[:-1]).all():
        d = d[np.argsort(dst, kind="stable")]
        dst = d[:, 1]
    if (dst[1:] < dst[:-1] + d[:-1, 2]).any():  # overlapping destinations: keep the caller's order
        return as_descs(descs)
    return d


def split(descs: np.ndarray, parts: int) -> list[np.ndarray]:
    """Cut a descriptor list into ``parts`` pieces of about equal bytes (rows split if needed),
    for moving them on several threads. Empty pieces are dropped."""
    d = as_descs(descs)
    if parts <= 1 or len(d) == 0:
        return [d]
    ends = np.cumsum(d[:, 2], dtype=np.uint64)
    total = int(ends[-1])
    cuts = sorted({total * k // parts for k in range(1, parts)} - {0}) + [total]
    out, row, off = [], 0, 0  # the next piece starts at byte `off` of row `row`
    for cut in cuts:
        last = int(np.searchsorted(ends, np.uint64(cut), side="left"))  # row holding byte cut-1
        piece = d[row:last + 1].copy()
        piece[0, :2] += np.uint64(off)
        piece[0, 2] -= np.uint64(off)
        tail = int(ends[last]) - cut  # bytes of row `last` left for the next piece
        piece[-1, 2] -= np.uint64(tail)
        piece = piece[piece[:, 2] > 0]
        if len(piece):
            out.append(piece)
        if tail:
            row, off = last, int(d[last, 2]) - tail
        else:
            row, off = last + 1, 0
    return out
