"""Tests for ``hybridflow.protocol.Batch``: construction, field access, row operations, serialization."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch


def _make(n: int = 4) -> Batch:
    """Rows i = 0..n-1: ids[i] = [i, 10 + i], score[i] = i / 2, uid[i] = "u{i}"."""
    ids = torch.stack([torch.arange(n), torch.arange(n) + 10], dim=1)  # (n, 2)
    return Batch(
        {"ids": ids, "score": torch.arange(n, dtype=torch.float32) / 2},
        {"uid": [f"u{i}" for i in range(n)]},
        {"temperature": 1.0},
    )


def _rows(b: Batch) -> list[int]:
    """Row identity: ids[:, 0] holds the original row number."""
    return b["ids"][:, 0].tolist()


# ---- construction and field access -------------------------------------------------------------------


def test_construction_and_access():
    b = _make(4)
    assert len(b) == 4 and b.batch_size == 4
    assert b.keys() == ["ids", "score", "uid"]
    assert "uid" in b and "ids" in b and "nope" not in b
    assert b["uid"].dtype == object and b["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert b["ids"].shape == (4, 2)
    assert b.meta == {"temperature": 1.0}
    with pytest.raises(KeyError, match="nope"):
        b["nope"]


def test_list_of_lists_stays_one_dimensional():
    b = Batch(non_tensors={"msgs": [[1, 2], [3, 4], [5, 6]]})
    assert b["msgs"].shape == (3,) and b["msgs"][1] == [3, 4]


def test_from_dict_matches_constructor():
    b = Batch.from_dict({"x": torch.zeros(3, 2)}, {"uid": ["a", "b", "c"]}, {"step": 7})
    assert len(b) == 3 and b.meta["step"] == 7 and b["uid"][2] == "c"


def test_validation_errors():
    with pytest.raises(ValueError, match=r"tensors\['b'\] has 3 rows but tensors\['a'\] has 4"):
        Batch({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensors\['uid'\] has 2 rows but tensors\['a'\] has 4"):
        Batch({"a": torch.zeros(4)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match="0-dim tensor"):
        Batch({"loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        Batch({"a": [1, 2]})
    with pytest.raises(TypeError, match="numpy array or a list"):
        Batch(non_tensors={"a": 3})
    with pytest.raises(ValueError, match="both tensors and non_tensors"):
        Batch({"a": torch.zeros(2)}, {"a": ["x", "y"]})


def test_empty_batch():
    b = Batch()
    assert len(b) == 0 and b.keys() == [] and b.nbytes() == 0
    assert b.split(2) == []
    assert [len(c) for c in b.chunk(2)] == [0, 0]
    with pytest.raises(IndexError):
        b[0]
    rows0 = Batch({"x": torch.zeros(0, 3)})
    assert len(rows0) == 0 and len(rows0.repeat(2)) == 0


def test_setitem():
    b = _make(3)
    b["mask"] = torch.ones(3, 2)
    b["tag"] = ["a", "b", "c"]
    assert b["tag"].dtype == object and b["mask"].shape == (3, 2)
    b["tag"] = torch.tensor([1, 2, 3])  # moves from non_tensors to tensors
    assert "tag" in b.tensors and "tag" not in b.non_tensors
    with pytest.raises(ValueError, match=r"batch\['bad'\] has 2 rows but tensors\['ids'\] has 3"):
        b["bad"] = torch.zeros(2)
    with pytest.raises(TypeError, match="meta"):
        b["temperature"] = 0.7
    single = Batch({"x": torch.zeros(3)})
    single["x"] = torch.zeros(5)  # replacing the only field may change the size
    assert len(single) == 5


def test_repr_shows_keys_shapes_dtypes():
    r = repr(_make(4))
    for part in [
        "batch_size=4",
        "'ids': (4, 2) torch.int64",
        "'score': (4,) torch.float32",
        "'uid': (4,) object",
    ]:
        assert part in r
    assert "'temperature': 1.0" in r


def test_not_iterable():
    with pytest.raises(TypeError, match="keys"):
        list(_make(2))


# ---- selecting and removing fields -------------------------------------------------------------------


def test_select():
    b = _make(4)
    s = b.select(["ids"], [], ["temperature"])
    assert s.keys() == ["ids"] and s.meta == {"temperature": 1.0}
    assert s["ids"] is b["ids"]  # no copy
    assert b.select(["score"]).keys() == ["score", "uid"]  # None keeps every non-tensor, as in verl
    assert b.select(non_tensor_keys=[]).keys() == ["ids", "score"]
    with pytest.raises(KeyError, match="missing"):
        b.select(["missing"])


def test_pop_is_atomic():
    b = _make(4)
    with pytest.raises(KeyError, match="nope"):
        b.pop(["ids", "nope"])
    assert b.keys() == ["ids", "score", "uid"]
    popped = b.pop(["score"], ["uid"], ["temperature"])
    assert popped.keys() == ["score", "uid"] and popped.meta == {"temperature": 1.0}
    assert b.keys() == ["ids"] and b.meta == {}


def test_drop_reports_bytes():
    b = Batch({"f32": torch.zeros(4, 3), "i64": torch.zeros(4, dtype=torch.int64)}, {"uid": list("abcd")})
    assert b.nbytes() == 4 * 3 * 4 + 4 * 8
    assert b.drop(["f32", "uid"]) == 48
    assert b.keys() == ["i64"]
    with pytest.raises(KeyError, match="gone"):
        b.drop(["gone"])
    assert b.drop(["gone", "i64"], missing_ok=True) == 32
    assert b.keys() == []


# ---- union -------------------------------------------------------------------------------------------


def test_union_merges_and_checks():
    a = _make(3)
    b = Batch({"ids": a["ids"].clone(), "adv": torch.ones(3)}, {"src": ["x", "y", "z"]}, {"step": 2})
    u = a.union(b)
    assert u.keys() == ["ids", "score", "adv", "uid", "src"]
    assert u.meta == {"temperature": 1.0, "step": 2}
    assert a.keys() == ["ids", "score", "uid"]  # union returns a new batch

    other = Batch({"ids": a["ids"] + 1})
    with pytest.raises(ValueError, match=r"tensors\['ids'\] differs"):
        a.union(other)
    with pytest.raises(ValueError, match=r"non_tensors\['uid'\] differs"):
        a.union(Batch(non_tensors={"uid": ["u0", "u1", "zz"]}))
    with pytest.raises(ValueError, match="3 and 2 rows"):
        a.union(Batch({"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"meta\['temperature'\] differs"):
        a.union(Batch(meta={"temperature": 0.5}))
    assert a.union(Batch()).keys() == a.keys()


def test_union_treats_nan_as_equal():
    x = torch.tensor([1.0, float("nan")])
    assert Batch({"x": x}).union(Batch({"x": x.clone()})).keys() == ["x"]


# ---- row operations ----------------------------------------------------------------------------------


def test_chunk_gives_views():
    b = _make(6)
    parts = b.chunk(3)
    assert [_rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p["uid"].tolist() for p in parts] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert parts[1]["ids"].untyped_storage().data_ptr() == b["ids"].untyped_storage().data_ptr()
    assert parts[2].meta == {"temperature": 1.0}
    with pytest.raises(ValueError, match=r"6 rows into 4 equal parts.*pad_to_divisor\(4\)"):
        b.chunk(4)
    with pytest.raises(ValueError, match="n >= 1"):
        b.chunk(0)


def test_pad_to_divisor_repeats_rows_from_the_start():
    padded, pad = _make(5).pad_to_divisor(4)
    assert pad == 3 and _rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert padded["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    # Fewer rows than the padding: wrap around again.
    padded, pad = _make(2).pad_to_divisor(5)
    assert pad == 3 and _rows(padded) == [0, 1, 0, 1, 0]
    same, pad = _make(4).pad_to_divisor(2)
    assert pad == 0 and _rows(same) == [0, 1, 2, 3]
    # The documented path: pad, chunk, process, concat, unpad.
    padded, pad = _make(5).pad_to_divisor(2)
    back = Batch.concat(padded.chunk(2)).unpad(pad)
    assert _rows(back) == [0, 1, 2, 3, 4] and back["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]
    with pytest.raises(ValueError, match="pad_size"):
        _make(2).unpad(3)


def test_split():
    assert [_rows(p) for p in _make(5).split(2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="size >= 1"):
        _make(2).split(0)


def test_concat():
    a, b = _make(2), _make(3)
    c = Batch.concat([a, b])
    assert _rows(c) == [0, 1, 0, 1, 2] and c["uid"].tolist() == ["u0", "u1", "u0", "u1", "u2"]
    assert c["score"].tolist() == [0.0, 0.5, 0.0, 0.5, 1.0] and c.meta == {"temperature": 1.0}
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"batch 1 and batch 0 have different fields \['score'\]"):
        Batch.concat([a, b.select(["ids"])])
    wide = Batch({"ids": torch.zeros(1, 3, dtype=torch.int64), "score": torch.zeros(1)}, {"uid": ["w"]})
    with pytest.raises(ValueError, match=r"tensors\['ids'\].*pad them"):
        Batch.concat([a, wide])
    hot = Batch(a.tensors, a.non_tensors, {"temperature": 0.6})
    with pytest.raises(ValueError, match=r"meta\['temperature'\] differs"):
        Batch.concat([a, hot])


def test_concat_widens_the_named_fields_on_their_side():
    left = Batch({"ids": torch.tensor([[1, 2, 3]]), "v": torch.tensor([[0.5]]), "n": torch.ones(1)})
    right = Batch({"ids": torch.tensor([[4]]), "v": torch.tensor([[0.1, 0.2]]), "n": torch.zeros(1)})
    c = Batch.concat([left, right], pad={"ids": ("left", 9), "v": ("right", 0.0), "n": ("left", 0)})
    assert c["ids"].tolist() == [[1, 2, 3], [9, 9, 4]] and c["ids"].dtype == torch.int64
    assert c["v"].tolist() == [[0.5, 0.0], [pytest.approx(0.1), pytest.approx(0.2)]]
    assert c["n"].tolist() == [1.0, 0.0]  # a 1-D field named in pad is joined as it is
    with pytest.raises(ValueError, match=r"tensors\['v'\].*or name 'v' in concat's pad="):
        Batch.concat([left, right], pad={"ids": ("left", 9)})
    with pytest.raises(ValueError, match="padding side must be 'left' or 'right'"):
        Batch.concat([left, right], pad={"ids": ("middle", 0), "v": ("right", 0.0)})


def test_repeat_interleaved_and_tiled():
    b = _make(2)
    inter = b.repeat(3)
    assert _rows(inter) == [0, 0, 0, 1, 1, 1]
    assert inter["ids"].tolist() == [[0, 10], [0, 10], [0, 10], [1, 11], [1, 11], [1, 11]]
    assert inter["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    tiled = b.repeat(2, interleave=False)
    assert _rows(tiled) == [0, 1, 0, 1] and tiled["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert tiled["ids"].tolist() == [[0, 10], [1, 11], [0, 10], [1, 11]]
    with pytest.raises(ValueError, match="n >= 1"):
        b.repeat(0)


def test_reorder_in_place():
    b = _make(4)
    assert b.reorder([2, 0, 3, 1]) is None
    assert _rows(b) == [2, 0, 3, 1] and b["uid"].tolist() == ["u2", "u0", "u3", "u1"]
    b.reorder(torch.tensor([1, 0, 2, 3]))
    assert _rows(b) == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2])


@pytest.mark.parametrize(
    "index, expected",
    [
        (slice(1, 3), [1, 2]),
        (slice(None, None, 2), [0, 2, 4]),
        (slice(None, None, -2), [4, 2, 0]),
        ([3, 0, 3], [3, 0, 3]),
        ([-1], [4]),
        (np.array([4, 1]), [4, 1]),
        (torch.tensor([2, 2, 0]), [2, 2, 0]),
        (torch.tensor([True, False, True, False, True]), [0, 2, 4]),
        (np.array([False, True, False, False, True]), [1, 4]),
        ([False, False, False, True, False], [3]),
        ([], []),
    ],
)
def test_getitem_rows(index, expected):
    b = _make(5)
    out = b[index]
    assert isinstance(out, Batch) and _rows(out) == expected
    assert out["uid"].tolist() == [f"u{i}" for i in expected]
    assert out.meta == b.meta


def test_getitem_int_returns_one_row_batch():
    b = _make(5)
    assert _rows(b[2]) == [2] and b[2]["ids"].shape == (1, 2)
    assert _rows(b[-1]) == [4] and _rows(b[torch.tensor(3)]) == [3]
    with pytest.raises(IndexError, match="out of range"):
        b[5]
    with pytest.raises(IndexError, match="out of range"):
        b[[0, 7]]
    with pytest.raises(ValueError, match="mask has 2 entries"):
        b[torch.tensor([True, False])]
    with pytest.raises(TypeError, match="integers or booleans"):
        b[np.array([0.5])]
    with pytest.raises(TypeError, match="unsupported Batch index type float"):
        b[1.5]


def test_slice_is_a_view():
    b = _make(5)
    view = b[1:3]
    view["ids"][0, 0] = 100
    assert b["ids"][1, 0] == 100


def test_to_and_contiguous():
    b = Batch({"t": torch.arange(6).reshape(2, 3).t()})  # (3, 2), transposed: not contiguous
    assert not b["t"].is_contiguous()
    c = b.contiguous()
    assert c["t"].is_contiguous() and torch.equal(c["t"], b["t"])
    d = b.to("cpu")
    assert d["t"].device.type == "cpu" and torch.equal(d["t"], b["t"])


# ---- serialization -----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    objs = ["text", 3, 2.5, {"k": [1, 2]}, None]
    b = Batch(
        {"x": torch.arange(10, dtype=torch.float32).reshape(5, 2), "m": torch.tensor([1, 0, 1, 1, 0]).bool()},
        {"obj": objs, "num": np.array([1, 2, 3, 4, 5]), "grid": np.arange(10).reshape(5, 2)},
        {"step": 3, "name": "run"},
    )
    path = tmp_path / "b.pt"
    b.save(path)
    back = Batch.load(path)
    assert back.keys() == b.keys() and back.meta == {"step": 3, "name": "run"}
    assert torch.equal(back["x"], b["x"]) and back["m"].dtype == torch.bool
    assert back["obj"].dtype == object and back["obj"].tolist() == objs
    assert back["num"].dtype == np.array([1]).dtype and back["num"].tolist() == [1, 2, 3, 4, 5]
    assert back["grid"].shape == (5, 2) and back["grid"][4].tolist() == [8, 9]


def test_save_of_a_slice_writes_only_the_slice(tmp_path):
    big = Batch({"x": torch.zeros(1000, 256)})  # 1 MB
    small = big[:10]  # 10 KB view of the 1 MB storage
    small.save(tmp_path / "s.pt")
    assert (tmp_path / "s.pt").stat().st_size < 20_000
    assert Batch.load(tmp_path / "s.pt")["x"].shape == (10, 256)


def test_load_rejects_foreign_files(tmp_path):
    torch.save({"x": torch.zeros(1)}, tmp_path / "f.pt")
    with pytest.raises(ValueError, match=r"not a file written by Batch\.save"):
        Batch.load(tmp_path / "f.pt")


def test_pickled_chunk_carries_only_its_rows():
    big = Batch({"x": torch.randn(1000, 256)}, {"uid": [str(i) for i in range(1000)]})  # 1 MB of float32
    part = big.chunk(10)[3]  # 100 rows, 100 KB of tensor data
    chunk_bytes = part.nbytes()
    assert chunk_bytes == 100 * 256 * 4
    # Control: plain pickling of the view writes the whole 1 MB base storage.
    assert len(pickle.dumps(part["x"])) > 10 * chunk_bytes
    blob = pickle.dumps(part)
    assert len(blob) < 1.2 * chunk_bytes
    back = pickle.loads(blob)
    assert torch.equal(back["x"], big["x"][300:400]) and back["uid"].tolist() == [
        str(i) for i in range(300, 400)
    ]
    assert back["x"].untyped_storage().nbytes() == chunk_bytes
    assert part["x"].untyped_storage().nbytes() == 1000 * 256 * 4  # the original is left untouched


def _worker(batch: Batch) -> Batch:
    """Runs in a spawned process: report the received storage size and return a derived batch."""
    storage = batch["x"].untyped_storage().nbytes()
    out = Batch({"y": batch["x"] * 2}, {"uid": batch["uid"]}, {"storage": storage, **batch.meta})
    return out


def test_multiprocessing_round_trip():
    big = Batch(
        {"x": torch.arange(40, dtype=torch.float32).reshape(20, 2)}, {"uid": list("abcdefghijklmnopqrst")}
    )
    part = big.chunk(4)[1]  # rows 5..9
    part.meta["step"] = 9
    with mp.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_worker, (part,))
    assert out["y"].tolist() == [[2.0 * (2 * r), 2.0 * (2 * r + 1)] for r in range(5, 10)]
    assert out["uid"].tolist() == list("fghij")
    assert out.meta == {"storage": 5 * 2 * 4, "step": 9}


class _Custom:
    def __init__(self, v: int) -> None:
        self.v = v


def test_load_of_unsafe_objects_needs_opt_in(tmp_path):
    Batch(non_tensors={"o": [_Custom(1), _Custom(2)]}).save(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="weights_only=False"):
        Batch.load(tmp_path / "c.pt")
    assert [o.v for o in Batch.load(tmp_path / "c.pt", weights_only=False)["o"]] == [1, 2]


def test_get_returns_default_for_missing_keys() -> None:
    b = Batch({"x": torch.zeros(2, 3)}, {"uid": ["a", "b"]})
    assert b.get("x").shape == (2, 3)
    assert list(b.get("uid")) == ["a", "b"]
    assert b.get("missing") is None
    assert b.get("missing", 5) == 5
