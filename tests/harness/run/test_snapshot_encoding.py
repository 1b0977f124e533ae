"""The snapshot encoding ([Note: Snapshot encoding] in harness/run/snapshot.py): what loads is
what was saved, bit for bit and type for type, and nothing but plain data is ever written."""

import math

import pytest
import torch

from harness.run.snapshot import FORMAT, decode, encode, load_snapshot, save_snapshot


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
    return bytes(t.view(torch.uint8).numpy()) if t.dtype != torch.bool else bytes(t.numpy())


def _same(a, b, path="") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert _bits(a) == _bits(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and str(a) == str(b), path  # str: -0.0 stays -0.0


def _awkward() -> dict:
    strided = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # not contiguous
    return {
        "format": FORMAT,
        "floats": [math.nan, math.inf, -math.inf, -0.0, 5e-324, 0.1, 1.0 + 2**-52],
        "tensors": {"strided": strided, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64),
                    "bools": torch.tensor([True, False]), "ints": torch.tensor([-(2**62), 7]),
                    "bf16": torch.tensor([1.5, -3.0], dtype=torch.bfloat16),
                    "nan": torch.tensor([math.nan, -0.0])},
        "tuple": (1, "a", (2.0, None)),
        "int_keys": {0: "zero", 1: [True, False]},
        "tuple_keys": {(1, 2): 3},
        "marker_key": {"__tensor__": 1},  # a user's dict that looks like a marker stays a dict
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "steps": [{"loss": torch.ones(2), "grads": {"w": torch.zeros(3)}}],
    }


def test_round_trip_is_exact(tmp_path):
    snap = _awkward()
    save_snapshot(tmp_path / "a.pt", snap)
    _same(snap, load_snapshot(tmp_path / "a.pt"))
    _same(snap, decode(encode(snap)))


def test_foreign_objects_are_refused_at_save(tmp_path):
    class Foreign:
        pass

    with pytest.raises(TypeError, match="Foreign"):
        save_snapshot(tmp_path / "a.pt", {"format": FORMAT, "x": Foreign()})
    assert not (tmp_path / "a.pt").exists()
    with pytest.raises(TypeError, match="set"):
        encode({"x": {1, 2}})


def test_contents_of_another_format_are_refused(tmp_path):
    torch.save({"format": FORMAT, "skeleton": '{"format": "other"}', "data": {}}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="not a fsdp-equiv-snapshot"):
        load_snapshot(tmp_path / "b.pt")


def test_digest_is_of_the_values_whatever_the_strides():
    from harness.run.snapshot import digest

    rows = torch.arange(68.0).view(2, 34)
    one = rows[:, 3:4].reshape(-1)[0:1].view(1, 1).clone()  # one element whose strides are (34, 34)
    assert one.stride() == (34, 34)
    assert digest(one) == digest(torch.tensor([[3.0]]))
    column = rows[:, 3:4]  # (2, 1) with the row stride 34
    assert digest(column) == digest(torch.tensor([[3.0], [37.0]])) != digest(torch.tensor([[37.0], [3.0]]))
    assert digest(rows.t()) == digest(rows.t().contiguous()) != digest(rows)
    assert digest(torch.ones(3, dtype=torch.bfloat16)) != digest(torch.ones(3))


@pytest.mark.parametrize("make", [lambda: torch.arange(12.0).view(3, 4), lambda: torch.arange(12.0).view(3, 4).t(),
                                  lambda: torch.arange(12.0).view(3, 4)[:, 1], lambda: torch.tensor(2.5),
                                  lambda: torch.zeros(0, 3), lambda: torch.randn(5).to(torch.bfloat16),
                                  lambda: torch.arange(6, dtype=torch.int64), lambda: torch.randn(4).requires_grad_()])
def test_digest_is_blake2b_of_the_row_major_bytes(make):
    """The definition, whatever layout the tensor has: read in place or copied first."""
    import hashlib

    from harness.run.snapshot import digest

    t = make()
    raw = t.detach().reshape(-1).contiguous().clone().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert digest(t) == int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 52) - 1)


def test_state_digest_is_blake2b_of_names_and_row_major_bytes():
    """The initial state's digest by its definition: per tensor in name order, its name, dtype and
    shape, then its bytes in row-major order, whatever the layout (read in place or copied)."""
    import hashlib

    from harness.run.snapshot import state_digest

    grid = torch.arange(12.0).view(3, 4)
    state = {"b.t": grid.t(), "a.col": grid[:, 1], "c.scalar": torch.tensor(2.5), "d.empty": torch.zeros(0, 3),
             "e.bf16": torch.randn(5).to(torch.bfloat16), "f.int": torch.arange(6, dtype=torch.int64)}
    buffers = {"g.buf": torch.ones(2, 2)[:, :1]}
    h = hashlib.blake2b(digest_size=16)
    for part in (state, buffers):
        for name in sorted(part):
            t = part[name]
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).contiguous().clone().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    assert state_digest(state, buffers) == h.hexdigest()
    assert state_digest(state, {"g.buf": torch.ones(2, 1)}) == h.hexdigest()  # the same values, laid out anew
    assert state_digest(state, {"g.buf": torch.full((2, 1), 2.0)}) != h.hexdigest()
