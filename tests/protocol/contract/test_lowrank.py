"""Truncated-SVD compression of weight maps (FedKD on the wire): energy, sizes, hostile factors."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.contract.lowrank import compress, is_compressed, restore
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError


def low_rank(m: int, n: int, rank: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(m, rank)) @ rng.normal(size=(rank, n))).astype(np.float32)


def test_a_low_rank_matrix_travels_as_its_factors_and_comes_back() -> None:
    # Prepare: a rank-3 64x48 matrix, a bias vector and an integer counter
    w = low_rank(64, 48, 3)
    tm = TensorMap({"fc.weight": w, "fc.bias": np.ones(64, np.float32), "n": np.array(7)})
    # Execute
    packed = compress(tm, 0.99)
    back = restore(packed)
    # Assert: only the matrix is factorised, at rank 3, and restored to float32 precision
    assert sorted(packed.tensors) == [
        "fc.bias",
        "fc.weight#s",
        "fc.weight#shape",
        "fc.weight#u",
        "fc.weight#v",
        "n",
    ]
    assert packed.tensors["fc.weight#s"].shape == (3,)
    assert packed.num_bytes < tm.num_bytes / 5
    np.testing.assert_allclose(back.tensors["fc.weight"], w, rtol=1e-4, atol=1e-4)
    assert back.tensors["n"].tolist() == 7 and is_compressed(packed) and not is_compressed(back)


def test_the_rank_keeps_the_asked_share_of_the_squared_norm() -> None:
    # Prepare: singular values 4, 2, 1 (squares 16, 4, 1 of 21) in a 30x20 matrix
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(30, 3)))
    v, _ = np.linalg.qr(rng.normal(size=(20, 3)))
    w = (u * [4.0, 2.0, 1.0]) @ v.T
    tm = TensorMap({"w": w.astype(np.float32)})
    # Execute / Assert: 16/21 = 0.76 -> rank 1; 20/21 = 0.952 -> rank 2 at 0.95; all at 0.99
    assert compress(tm, 0.76).tensors["w#s"].size == 1
    assert compress(tm, 0.95).tensors["w#s"].size == 2
    assert compress(tm, 0.99).tensors["w#s"].size == 3


@pytest.mark.parametrize("shape", [(40, 300), (300, 40)])
def test_the_factors_are_the_truncated_svd_of_a_wide_or_tall_matrix(
    shape: tuple[int, int],
) -> None:
    # Prepare: singular values 1 / (i + 1), so 0.9 of the squared norm needs several of them
    m, n = shape
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.normal(size=(m, 40)))
    v, _ = np.linalg.qr(rng.normal(size=(n, 40)))
    w = ((u / np.arange(1, 41)) @ v.T).astype(np.float32)
    # Execute
    f = compress(TensorMap({"w": w}), 0.9).tensors
    # Assert: numpy's SVD at the same rank, orthonormal factors, descending singular values
    ref_u, ref_s, ref_vt = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    r = f["w#s"].size
    assert 1 < r < 40
    np.testing.assert_allclose(f["w#s"], ref_s[:r], rtol=1e-5)
    np.testing.assert_allclose(
        f["w#u"] @ (f["w#s"][:, None] * f["w#v"]),
        ref_u[:, :r] @ (ref_s[:r, None] * ref_vt[:r]),
        atol=1e-6,
    )
    np.testing.assert_allclose(f["w#u"].T @ f["w#u"], np.eye(r), atol=1e-5)
    np.testing.assert_allclose(f["w#v"] @ f["w#v"].T, np.eye(r), atol=1e-5)
    assert np.all(np.diff(f["w#s"]) <= 0)


def test_conv_kernels_are_factorised_as_out_by_the_rest_and_keep_their_shape() -> None:
    kernel = low_rank(32, 16 * 3 * 3, 2).reshape(32, 16, 3, 3)
    back = restore(compress(TensorMap({"conv.weight": kernel}), 0.999))
    assert back.tensors["conv.weight"].shape == (32, 16, 3, 3)
    np.testing.assert_allclose(back.tensors["conv.weight"], kernel, rtol=1e-4, atol=1e-4)


def test_a_full_rank_matrix_that_would_not_shrink_travels_whole() -> None:
    w = np.random.default_rng(2).normal(size=(8, 8)).astype(np.float32)
    packed = compress(TensorMap({"w": w}), 0.98)
    assert list(packed.tensors) == ["w"] and np.array_equal(packed.tensors["w"], w)


def factors(m: int = 6, n: int = 4, r: int = 2) -> dict[str, np.ndarray]:
    return {
        "w#u": np.ones((m, r), np.float32),
        "w#s": np.ones(r, np.float32),
        "w#v": np.ones((r, n), np.float32),
        "w#shape": np.array([m, n]),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"w#v": None}, "missing ['v']"),
        ({"w#u": np.ones((5, 2), np.float32)}, "shape [6, 2]"),
        ({"w#v": np.ones((2, 5), np.float32)}, "shape [2, 4]"),
        ({"w#s": np.ones(5, np.float32)}, "rank 1..4"),
        ({"w#shape": np.array([6, 0])}, "positive sizes"),
        ({"w#shape": np.array([6, 5])}, "shape [2, 5]"),
        ({"w#shape": np.array([1 << 14, 1 << 14])}, "elements"),
        ({"w#x": np.ones(2, np.float32)}, "one of"),
        ({"w": np.ones((6, 4), np.float32)}, "either the tensor or its factors"),
    ],
)
def test_hostile_factor_sets_are_refused_with_the_field_named(
    change: dict[str, np.ndarray | None], message: str
) -> None:
    tensors = {**factors(), **change}
    tm = TensorMap({k: v for k, v in tensors.items() if v is not None})
    with pytest.raises(ValidationError, match="upload") as err:
        restore(tm, "upload")
    assert message in str(err.value)


def test_factors_whose_product_overflows_float32_are_refused() -> None:
    big = factors()
    big["w#s"] = np.full(2, 3e38, np.float32)
    with pytest.raises(ValidationError, match="within float32"):
        restore(TensorMap(big), "upload")
