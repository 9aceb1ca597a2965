"""MNIST from the four standard IDX files. An IDX file is a big-endian uint32 magic
number `0x0800 + ndim` (type `0x08`, unsigned byte), `ndim` big-endian uint32 sizes,
then `prod(sizes)` bytes in C order. Nothing is downloaded."""

import gzip
import os

import numpy as np

IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
_UBYTE = 0x08

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

_SOURCE = (
    "Get the four MNIST files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, gzipped or not) from "
    "http://yann.lecun.com/exdb/mnist/ or its mirror "
    "https://ossci-datasets.s3.amazonaws.com/mnist/ (the one torchvision uses) and "
    "put them directly in `root`."
)


def _find(root, name: str) -> str:
    root = os.fspath(root)
    plain = os.path.join(root, name)
    for path in (plain, plain + ".gz"):
        if os.path.isfile(path):
            return path
    where = (
        f"expected {plain!r} or {plain + '.gz'!r}"
        if os.path.isdir(root)
        else f"the directory {root!r} does not exist"
    )
    raise FileNotFoundError(f"MNIST file not found: {where}. {_SOURCE}")


def _read_bytes(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path!r} is not a readable (gzip) file: {e}") from e


def read_idx(path: str | os.PathLike, magic: int | None = None) -> np.ndarray:
    """Reads one unsigned-byte IDX file (optionally gzipped) into a uint8 array.

    **Arguments:**

    - `path`: the file. It is read as gzip when its name ends in `.gz`.
    - `magic`: the magic number the file must have (2051 for MNIST images, 2049 for
        labels). `None` (the default) accepts any unsigned-byte IDX file.

    **Returns:**

    A uint8 NumPy array with the shape that the header gives.

    Raises `ValueError` for a wrong magic number, a type other than unsigned byte, a
    truncated file, or a file with bytes after the data.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import read_idx, write_idx

        write_idx("labels.idx.gz", np.array([5, 0, 4], dtype=np.uint8))
        print(read_idx("labels.idx.gz", magic=2049))  # [5 0 4]
        ```
    """
    path = os.fspath(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path!r} is truncated: {len(raw)} bytes, no IDX header.")
    found = int.from_bytes(raw[:4], "big")
    if magic is not None and found != magic:
        raise ValueError(
            f"{path!r} has magic number {found} (0x{found:08x}); expected {magic} "
            f"(0x{magic:08x}). Is it the right (and uncompressed or .gz) IDX file?"
        )
    if raw[0] != 0 or raw[1] != 0 or raw[2] != _UBYTE:
        raise ValueError(
            f"{path!r} has magic number 0x{found:08x}: not an unsigned-byte IDX file."
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"{path!r} is truncated: {len(raw)} bytes, the header needs {header}."
        )
    shape = tuple(
        int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    n_data = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != n_data:
        what = "truncated" if len(raw) - header < n_data else "longer than its header"
        raise ValueError(
            f"{path!r} is {what}: the header says shape {shape}, {n_data} data "
            f"bytes, the file has {len(raw) - header}."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Writes a uint8 array as an IDX file with the magic number `0x0800 + ndim`.

    **Arguments:**

    - `path`: the file to write. It is gzipped when its name ends in `.gz`.
    - `array`: a uint8 array with 1 to 255 dimensions; a `ValueError` otherwise.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import read_idx, write_idx

        images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
        write_idx("tiny.idx", images)
        print(read_idx("tiny.idx", magic=2051).shape)  # (2, 3, 4)
        ```
    """
    array = np.asarray(array)
    if array.dtype != np.uint8:
        raise ValueError(f"write_idx writes uint8 arrays only, got {array.dtype}.")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"an IDX array needs 1 to 255 dimensions, got {array.ndim}.")
    header = bytes([0, 0, _UBYTE, array.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in array.shape
    )
    payload = header + np.ascontiguousarray(array).tobytes()
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _load_pair(root, images_name: str, labels_name: str):
    images_path = _find(root, images_name)
    labels_path = _find(root, labels_name)
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_path!r} holds {images.shape[0]} images but {labels_path!r} "
            f"{labels.shape[0]} labels."
        )
    return images, labels


def load_mnist_idx(
    root: str | os.PathLike,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reads MNIST's four IDX files from the folder `root`. Nothing is downloaded.

    **Arguments:**

    - `root`: the folder that holds the files named in `MNIST_FILES`, each
        optionally gzipped (`name.gz`; the uncompressed file wins if both exist),
        from http://yann.lecun.com/exdb/mnist/ or its mirror
        https://ossci-datasets.s3.amazonaws.com/mnist/.

    **Returns:**

    `(train_images, train_labels, test_images, test_labels)`: uint8 arrays, the
    images of shape `(n, rows, cols)` and the labels `(n,)`.

    Raises `FileNotFoundError` if a file is missing (the message says where to get
    it), and `ValueError` for a wrong magic number, a truncated file, or a count
    mismatch between images and labels.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import load_mnist_idx, write_idx

        # Four tiny files in the real format, in the working directory.
        write_idx("train-images-idx3-ubyte", np.zeros((3, 28, 28), np.uint8))
        write_idx("train-labels-idx1-ubyte", np.array([5, 0, 4], np.uint8))
        write_idx("t10k-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
        write_idx("t10k-labels-idx1-ubyte.gz", np.array([7, 2], np.uint8))

        train_x, train_y, test_x, test_y = load_mnist_idx(".")
        print(train_x.shape, test_y)  # (3, 28, 28) [7 2]
        ```
    """
    train_images, train_labels = _load_pair(root, *MNIST_FILES[:2])
    test_images, test_labels = _load_pair(root, *MNIST_FILES[2:])
    return train_images, train_labels, test_images, test_labels
