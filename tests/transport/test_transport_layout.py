"""Descriptor building: the C core, its Python twin and the numpy version agree, and all of them
match an independent byte-by-byte model of the contract written in transport/layout.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import layout

from transport_testlib import load_core

U64 = 1 << 64


@st.composite
def ids_lists(draw, n):
    kind = draw(st.sampled_from(["random", "run", "runs"]))
    if kind == "run":  # contiguous ids: the case merging must collapse
        start = draw(st.integers(0, 8))
        return list(range(start, start + n))
    ids = draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))
    return sorted(ids) if kind == "runs" else ids


@st.composite
def layouts(draw):
    sbb = draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 32]))
    dbb = draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 32]))
    sst = draw(st.sampled_from([0, sbb, sbb + 1, 2 * sbb]))
    dst = draw(st.sampled_from([0, dbb, dbb + 3, 2 * dbb]))
    si = draw(ids_lists(draw(st.integers(0, 10))))
    di = draw(ids_lists(draw(st.integers(0, 10))))
    planes = draw(st.integers(0, 3))
    span_s, span_d = 16 * max(sst, sbb), 16 * max(dst, dbb)
    if draw(st.booleans()):  # planes back to back: merging may cross a plane boundary
        sb = [4096 + p * span_s for p in range(planes)]
        db = [1 << 20 | p * span_d for p in range(planes)]
    else:
        sb = draw(st.lists(st.integers(0, 1 << 16), min_size=planes, max_size=planes))
        db = draw(st.lists(st.integers(1 << 17, 1 << 18), min_size=planes, max_size=planes))
    total = min(len(si) * sbb, len(di) * dbb)
    nbytes = draw(st.one_of(st.none(), st.integers(0, total)))
    return dict(src_bases=sb, dst_bases=db, src_block_bytes=sbb, dst_block_bytes=dbb,
                src_ids=si, dst_ids=di, nbytes=nbytes, src_stride=sst, dst_stride=dst)


def model(src_bases, dst_bases, src_block_bytes, dst_block_bytes, src_ids, dst_ids, nbytes,
          src_stride, dst_stride):
    """Byte k of plane p goes from here to there: the contract, one byte at a time."""
    sst, dst = src_stride or src_block_bytes, dst_stride or dst_block_bytes
    total = min(len(src_ids) * src_block_bytes, len(dst_ids) * dst_block_bytes)
    total = total if nbytes is None else nbytes
    pairs = []
    for sb, db in zip(src_bases, dst_bases):
        for k in range(total):
            s = sb + src_ids[k // src_block_bytes] * sst + k % src_block_bytes
            d = db + dst_ids[k // dst_block_bytes] * dst + k % dst_block_bytes
            pairs.append((s, d))
    return pairs


def expand(descs: np.ndarray):
    return [(s + i, d + i) for s, d, n in descs.tolist() for i in range(n)]


def check_shape(descs: np.ndarray) -> None:
    assert descs.dtype == np.uint64 and descs.ndim == 2 and descs.shape[1] == 3
    rows = descs.tolist()
    assert all(n > 0 for _, _, n in rows)
    for (s0, d0, n0), (s1, d1, _) in zip(rows, rows[1:]):  # fewest: nothing left to merge
        assert not (s0 + n0 == s1 and d0 + n0 == d1)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_c_twin_numpy_and_model_agree(lay):
    c, py = load_core("c"), load_core("python")
    out_c = layout.build_descriptors(**lay, core=c)
    out_py = layout.build_descriptors(**lay, core=py)
    out_np = layout.build_descriptors_numpy(**lay)
    check_shape(out_c)
    assert np.array_equal(out_c, out_py)
    assert np.array_equal(out_c, out_np.reshape(-1, 3))
    assert expand(out_c) == model(**lay)


def test_contiguous_blocks_collapse_to_one_descriptor_per_plane(core):
    bases_s, bases_d = [0x10000, 0x900000], [0x4000000, 0x8000000]
    out = layout.build_descriptors(bases_s, bases_d, 4096, 4096, range(10, 110), range(0, 100), core=core)
    assert out.tolist() == [[0x10000 + 10 * 4096, 0x4000000, 100 * 4096],
                            [0x900000 + 10 * 4096, 0x8000000, 100 * 4096]]


def test_differing_block_sizes_small_onto_large(core):
    # Four 16-byte source blocks fill two 32-byte destination blocks, in order.
    out = layout.build_descriptors([0], [1000], 16, 32, [3, 2, 0, 1], [5, 7], core=core)
    assert out.tolist() == [[48, 1160, 16], [32, 1176, 16], [0, 1224, 32]]


def test_large_layout_agrees(core):
    rng = np.random.default_rng(7)
    planes, blocks, bb = 64, 1000, 65536
    sb = (np.arange(planes, dtype=np.uint64) * np.uint64(blocks * bb)) + np.uint64(1 << 30)
    db = sb + np.uint64(1 << 40)
    si, di = rng.permutation(blocks), rng.permutation(blocks)
    out = layout.build_descriptors(sb, db, bb, bb, si, di, core=core)
    assert out.shape == (planes * blocks, 3)
    assert np.array_equal(out, layout.build_descriptors_numpy(sb, db, bb, bb, si, di))


BAD = [
    (dict(src_bases=[0, 1], dst_bases=[0]), ValueError),
    (dict(src_block_bytes=0), ValueError),
    (dict(src_stride=8), ValueError),  # stride < block bytes
    (dict(nbytes=1 << 20), ValueError),
    (dict(src_bases=[U64 - 16]), OverflowError),
    (dict(src_ids=[1 << 62, 1]), OverflowError),
    (dict(dst_block_bytes=-16), OverflowError),
]


@pytest.mark.parametrize("change,exc", BAD)
def test_bad_arguments_raise_the_same_error_in_both_cores(change, exc):
    args = dict(src_bases=[0], dst_bases=[1 << 20], src_block_bytes=16, dst_block_bytes=16,
                src_ids=[0, 1], dst_ids=[2, 3], nbytes=-1, src_stride=0, dst_stride=0)
    args.update(change)
    for name in ("c", "python"):
        mod = load_core(name)
        a = dict(args)
        for k in ("src_bases", "dst_bases", "src_ids", "dst_ids"):
            a[k] = np.array(a[k], dtype=np.uint64)
        with pytest.raises(exc):
            mod.build_descriptors(**a)


def test_seam_rejects_negative_ids(core):
    with pytest.raises(ValueError, match="negative"):
        layout.build_descriptors([0], [0], 16, 16, [0, -1], [0, 1], core=core)


def test_region_table_rejects_spans_outside():
    from transport.base import Region, RegionError

    table = layout.RegionTable([Region(1000, 100), Region(5000, 10)])
    ok = np.array([[1000, 0, 100], [5000, 0, 10]], dtype=np.uint64)
    assert table.check(ok, 0, "x").tolist() == [0, 1]
    for bad in ([999, 0, 2], [1050, 0, 51], [5000, 0, 11], [2000, 0, 1], [1000, 0, 0]):
        with pytest.raises(RegionError):
            table.check(np.array([bad], dtype=np.uint64), 0, "x")
    with pytest.raises(RegionError, match="overlaps"):
        table.add(Region(1050, 100))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 40)),
                min_size=1, max_size=8), st.integers(1, 70))
def test_split_keeps_every_byte_in_order(rows, parts):
    descs = np.array(rows, dtype=np.uint64)
    pieces = layout.split(descs, parts)
    assert len(pieces) == min(parts, int(descs[:, 2].sum()))
    assert all(len(p) and (p[:, 2] > 0).all() for p in pieces)
    assert expand(np.concatenate(pieces)) == expand(descs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(1, 40)),
                min_size=0, max_size=12))
def test_by_destination_sorts_only_when_destinations_are_disjoint(rows):
    descs = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    out = layout.by_destination(descs)
    spans = sorted((d, d + n) for _, d, n in rows)
    disjoint = all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    if disjoint:  # same rows, destination order: the same bytes land in the same places
        assert sorted(map(tuple, out.tolist())) == sorted(map(tuple, descs.tolist()))
        assert out[:, 1].tolist() == sorted(out[:, 1].tolist())
    else:  # overlapping destinations: order decides the result, so it is kept
        assert np.array_equal(out, descs)
