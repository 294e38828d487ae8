"""DataProto: the one payload between the driver and the workers (tensors, per-sample objects, meta info)."""

# Shape legend: B = rows of the batch (samples); every tensor and non-tensor array has B first.

from __future__ import annotations

import collections.abc
import sys
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto", "UnknownKeyError"]

# One row index of any form a user may write: data[3], data[1:5], data[[0, 2]], data[mask_B], ...
RowIndex = int | slice | Sequence[int] | np.ndarray | torch.Tensor


class UnknownKeyError(KeyError, ValueError):
    """A key that is not in the DataProto; a KeyError for mapping habits and a ValueError for the rest."""

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the whole message in quotes.
        return str(self.args[0]) if self.args else ""


class DataProto:
    """A batch of B samples: `batch` (a TensorDict of tensors, batch_size [B]), `non_tensor_batch`
    ({key: 1-D numpy object array of length B}: strings, dicts, any per-sample Python value) and
    `meta_info` (a plain dict for the whole batch: temperatures, step numbers, flags).

    Row operations (indexing, chunk, split, concat, repeat, ...) act on tensors and non-tensors
    together and copy `meta_info` shallowly. Tensor keys and non-tensor keys share one namespace.
    """

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> None:
        if batch is not None:
            _check_tensordict(batch)
        if meta_info is not None and not isinstance(meta_info, dict):
            raise ValueError(f"meta_info must be a dict, got {type(meta_info).__name__}")
        self.batch: TensorDict | None = batch
        self.non_tensor_batch: dict[str, np.ndarray] = {}
        self.meta_info: dict = meta_info if meta_info is not None else {}
        for key, values in (non_tensor_batch or {}).items():
            if batch is not None and key in batch.keys():
                raise ValueError(f"key {key!r} is both a tensor and a non-tensor; each key names one of them")
            array = self.non_tensor_batch[key] = _as_object_array(key, values)
            self._check_rows(key, len(array), kind="non-tensor")

    # ----------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Sequence | np.ndarray] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Build from plain dicts; every tensor and non-tensor must have the same first dimension B."""
        tensors = tensors or {}
        batch = None
        if tensors:
            num_rows = None
            for key, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"tensor {key!r} must be a torch.Tensor, got {type(tensor).__name__}; "
                                     "put per-sample Python values in non_tensors")
                if tensor.dim() == 0:
                    raise ValueError(f"tensor {key!r} is a scalar; batch tensors need a first dimension B "
                                     "(put whole-batch values in meta_info)")
                if num_rows is None:
                    num_rows, first_key = tensor.shape[0], key
                elif tensor.shape[0] != num_rows:
                    raise ValueError(f"tensor {key!r} has {tensor.shape[0]} rows but tensor {first_key!r} "
                                     f"has {num_rows}; all batch entries need the same first dimension")
            batch = TensorDict(dict(tensors), batch_size=[num_rows])
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Build from one dict mixing tensors (become tensors) and per-sample sequences (non-tensors)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    # ----------------------------------------------------------------------------------------------
    # Mapping view: len, keys, get/set/delete by name
    # ----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for array in self.non_tensor_batch.values():
            return len(array)
        return 0

    def keys(self) -> list[str]:
        """Tensor keys first, then non-tensor keys."""
        return self._tensor_keys() + list(self.non_tensor_batch)

    def __contains__(self, key: object) -> bool:
        return key in self.non_tensor_batch or (self.batch is not None and key in self.batch.keys())

    def get(self, key: str, default: Any = None) -> Any:
        """The tensor or non-tensor array named `key`, or `default` when there is none."""
        return self[key] if key in self else default

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a tensor (torch.Tensor) or a non-tensor (list/tuple/1-D array); replaces a key of either kind."""
        if not isinstance(key, str):
            raise ValueError(f"keys are strings, got {type(key).__name__} {key!r}")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"tensor {key!r} is a scalar; batch tensors need a first dimension B "
                                 "(put whole-batch values in meta_info)")
            self._fit_rows_for_set(key, value.shape[0], kind="tensor")
            self.non_tensor_batch.pop(key, None)
            if self.batch is None:
                self.batch = TensorDict({}, batch_size=[value.shape[0]])
            self.batch[key] = value
            return
        array = _as_object_array(key, value)
        self._fit_rows_for_set(key, len(array), kind="non-tensor")
        if self.batch is not None and key in self.batch.keys():
            del self.batch[key]
        self.non_tensor_batch[key] = array

    def __delitem__(self, key: str) -> None:
        if key in self.non_tensor_batch:
            del self.non_tensor_batch[key]
        elif self.batch is not None and key in self.batch.keys():
            del self.batch[key]
        else:
            raise self._unknown_key(key)

    def _has_rows(self) -> bool:
        """Whether this DataProto carries per-sample data (a batch, even without keys, or non-tensors)."""
        return self.batch is not None or bool(self.non_tensor_batch)

    def _check_rows(self, key: str, num_rows: int, *, kind: str) -> None:
        if num_rows != len(self):
            raise ValueError(f"{kind} {key!r} has {num_rows} rows but this DataProto has {len(self)} "
                             f"(keys {self.keys()}); every entry needs the same first dimension")

    def _fit_rows_for_set(self, key: str, num_rows: int, *, kind: str) -> None:
        """Before setting `key`: an entry must match B, unless no other key is held (then it defines B)."""
        if any(k != key for k in self.keys()):
            self._check_rows(key, num_rows, kind=kind)
        elif self.batch is not None and len(self) != num_rows:
            self.batch = TensorDict({}, batch_size=[num_rows])

    def _unknown_key(self, key: object) -> UnknownKeyError:
        return UnknownKeyError(f"unknown key {key!r}; available: tensors {self._tensor_keys()}, "
                               f"non-tensors {list(self.non_tensor_batch)}, meta_info {list(self.meta_info)}")

    def _tensor_keys(self) -> list[str]:
        return list(self.batch.keys()) if self.batch is not None else []

    # ----------------------------------------------------------------------------------------------
    # Rows: indexing, slicing, reordering
    # ----------------------------------------------------------------------------------------------

    def __getitem__(self, index: str | RowIndex) -> Any:
        """`data["key"]` -> the tensor or non-tensor array; any row index -> a new DataProto of those rows.

        Slices give views (writes show through to `self`); integer lists, arrays and masks copy rows.
        An int gives a DataProto of length 1.
        """
        if isinstance(index, str):
            if self.batch is not None and index in self.batch.keys():
                return self.batch[index]
            if index in self.non_tensor_batch:
                return self.non_tensor_batch[index]
            raise self._unknown_key(index)
        if isinstance(index, slice):
            return self._slice(index)
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            row = int(index)
            if not -len(self) <= row < len(self):
                raise IndexError(f"row {row} is out of range for a DataProto of {len(self)} rows")
            row %= len(self)
            return self._slice(slice(row, row + 1))
        return self._take(self._row_indices(index))

    def _row_indices(self, index: RowIndex) -> np.ndarray:
        """Normalize a list/array/tensor index or mask to int64 row numbers in [0, B)."""
        if isinstance(index, torch.Tensor):
            index = index.detach().cpu().numpy()
        elif not isinstance(index, np.ndarray):
            if not isinstance(index, collections.abc.Sequence):
                raise TypeError(f"cannot index a DataProto with {type(index).__name__}; use a key, an int, "
                                "a slice, a list of ints, or an int/bool numpy array or tensor")
            index = np.asarray(index) if len(index) else np.zeros(0, dtype=np.int64)
        if index.ndim != 1:
            raise ValueError(f"row indices must be 1-D, got shape {tuple(index.shape)}")
        if index.dtype == np.bool_:
            if len(index) != len(self):
                raise ValueError(f"boolean mask has {len(index)} entries but the DataProto has {len(self)} rows")
            return np.flatnonzero(index).astype(np.int64)
        if not np.issubdtype(index.dtype, np.integer):
            raise TypeError(f"row indices must be integers or booleans, got dtype {index.dtype}")
        rows = index.astype(np.int64)
        if len(rows) and (rows.min() < -len(self) or rows.max() >= len(self)):
            bad = rows[(rows < -len(self)) | (rows >= len(self))][0]
            raise IndexError(f"row {bad} is out of range for a DataProto of {len(self)} rows")
        return rows % max(len(self), 1)

    def _slice(self, rows: slice) -> DataProto:
        batch = self.batch[rows] if self.batch is not None else None
        non_tensors = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensors, dict(self.meta_info))

    def _take(self, rows_R: np.ndarray) -> DataProto:
        batch = self.batch[torch.from_numpy(rows_R)] if self.batch is not None else None
        non_tensors = {k: v[rows_R] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensors, dict(self.meta_info))

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Reorder rows in place: row i becomes old row indices[i]; indices must be a permutation of range(B)."""
        rows_B = self._row_indices(indices)
        if len(rows_B) != len(self) or not np.array_equal(np.sort(rows_B), np.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {len(rows_B)} indices "
                             f"{rows_B[:8].tolist()}{' ...' if len(rows_B) > 8 else ''}")
        reordered = self._take(rows_B)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    # ----------------------------------------------------------------------------------------------
    # Keys: select, pop, union
    # ----------------------------------------------------------------------------------------------

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A new DataProto with only the named keys of each kind; None keeps every key of that kind.

        Tensors and non-tensor arrays are shared with `self` (not copied); meta_info is a shallow copy.
        """
        batch_keys = self._checked_keys(batch_keys, self._tensor_keys(), "batch_keys")
        non_tensor_keys = self._checked_keys(non_tensor_keys, list(self.non_tensor_batch), "non_tensor_keys")
        meta_keys = self._checked_keys(meta_keys, list(self.meta_info), "meta_keys")
        batch = self.batch.select(*batch_keys) if self.batch is not None else None
        non_tensors = {k: self.non_tensor_batch[k] for k in non_tensor_keys}
        return DataProto(batch, non_tensors, {k: self.meta_info[k] for k in meta_keys})

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from `self` and return them as a new DataProto; None pops none of that kind.

        The popped DataProto keeps the row count even when it holds no tensor (its batch is empty).
        """
        batch_keys = self._checked_keys(batch_keys or [], self._tensor_keys(), "batch_keys")
        non_tensor_keys = self._checked_keys(non_tensor_keys or [], list(self.non_tensor_batch), "non_tensor_keys")
        meta_keys = self._checked_keys(meta_keys or [], list(self.meta_info), "meta_keys")
        popped = self.select(batch_keys, non_tensor_keys, meta_keys)
        for key in batch_keys:
            del self.batch[key]
        for key in non_tensor_keys:
            del self.non_tensor_batch[key]
        for key in meta_keys:
            del self.meta_info[key]
        return popped

    def _checked_keys(self, wanted: Iterable[str] | None, available: list[str], argument: str) -> list[str]:
        if wanted is None:
            return list(available)
        if isinstance(wanted, str):
            raise ValueError(f"{argument} must be a list of key names, got the string {wanted!r} "
                             f"(write [{wanted!r}])")
        wanted = list(wanted)
        for key in wanted:
            if key not in available:
                raise UnknownKeyError(f"unknown key {key!r} in {argument}; available: {available}")
        return wanted

    def union(self, other: DataProto) -> DataProto:
        """A new DataProto with the keys of both; a key present in both must hold equal values.

        Raises ValueError naming the key when the values differ, or naming both sizes when the row
        counts differ. Tensors are shared, not copied.
        """
        if not isinstance(other, DataProto):
            raise ValueError(f"union needs a DataProto, got {type(other).__name__}")
        if self._has_rows() and other._has_rows() and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of different sizes: {len(self)} rows and {len(other)} rows")
        tensors = {k: self.batch[k] for k in self._tensor_keys()}
        for key in other._tensor_keys():
            value = other.batch[key]
            if key in self.non_tensor_batch:
                raise ValueError(f"key {key!r} is a non-tensor on the left and a tensor on the right of union")
            if key in tensors and not _tensors_equal(tensors[key], value):
                raise ValueError(f"union conflict on tensor {key!r}: both sides have it with different values "
                                 f"({_describe_tensor(tensors[key])} vs {_describe_tensor(value)})")
            tensors.setdefault(key, value)
        non_tensors = dict(self.non_tensor_batch)
        for key, array in other.non_tensor_batch.items():
            if key in tensors:
                raise ValueError(f"key {key!r} is a tensor on one side and a non-tensor on the other of union")
            if key in non_tensors and not _object_arrays_equal(non_tensors[key], array):
                raise ValueError(f"union conflict on non-tensor {key!r}: both sides have it with different values")
            non_tensors.setdefault(key, array)
        meta_info = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta_info and not _values_equal(meta_info[key], value):
                raise ValueError(f"union conflict on meta_info {key!r}: {meta_info[key]!r} vs {value!r}")
            meta_info.setdefault(key, value)
        batch = None
        if self.batch is not None or other.batch is not None:
            num_rows = len(self) if self._has_rows() else len(other)
            batch = TensorDict(tensors, batch_size=[num_rows])
        return DataProto(batch, non_tensors, meta_info)

    # ----------------------------------------------------------------------------------------------
    # Splitting and joining: pad/unpad, chunk, split, concat, repeat
    # ----------------------------------------------------------------------------------------------

    def pad_to_multiple(self, multiple: int) -> tuple[DataProto, int]:
        """(padded, pad_size): rows repeated from the start (wrapping) until len is a multiple of `multiple`."""
        _check_positive_int("multiple", multiple)
        pad_size = -len(self) % multiple
        if pad_size == 0:
            return self._slice(slice(None)), 0
        pad_rows = np.arange(pad_size, dtype=np.int64) % len(self)
        return DataProto.concat([self, self._take(pad_rows)]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` rows (the inverse of pad_to_multiple after chunk -> concat)."""
        if not isinstance(pad_size, (int, np.integer)) or not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be an int in [0, {len(self)}], got {pad_size!r}")
        return self._slice(slice(0, len(self) - int(pad_size)))

    def chunk(self, num_chunks: int) -> list[DataProto]:
        """`num_chunks` equal chunks, in order. Pads first (see pad_to_multiple) when len is not a multiple;
        callers that must undo the padding call pad_to_multiple themselves and keep pad_size."""
        _check_positive_int("num_chunks", num_chunks)
        padded, _ = self.pad_to_multiple(num_chunks)
        rows_per_chunk = len(padded) // num_chunks
        return [padded._slice(slice(i * rows_per_chunk, (i + 1) * rows_per_chunk)) for i in range(num_chunks)]

    def split(self, rows_per_split: int) -> list[DataProto]:
        """Consecutive pieces of `rows_per_split` rows; the last may be shorter. No padding."""
        _check_positive_int("rows_per_split", rows_per_split)
        return [self._slice(slice(start, start + rows_per_split)) for start in range(0, len(self), rows_per_split)]

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order (tensors cat along dim 0, non-tensors concatenated); meta_info of the first.

        Every part must have the same keys, and each tensor key the same dtype, trailing shape and device.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("concat needs at least one DataProto, got an empty list")
        for position, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise ValueError(f"concat part {position} is a {type(part).__name__}, not a DataProto")
        first = parts[0]
        for position, part in enumerate(parts[1:], start=1):
            for what, mine, theirs in (("tensor", first._tensor_keys(), part._tensor_keys()),
                                       ("non-tensor", list(first.non_tensor_batch), list(part.non_tensor_batch))):
                if set(mine) != set(theirs):
                    missing = sorted(set(mine) ^ set(theirs))
                    raise ValueError(f"concat: {what} key(s) {missing} are in part 0 or part {position} but not "
                                     f"both (part 0 has {sorted(mine)}, part {position} has {sorted(theirs)})")
            if (first.batch is None) != (part.batch is None):
                raise ValueError(f"concat: part 0 and part {position} disagree on having a tensor batch")
        batch = None
        if first.batch is not None:
            tensors = {key: _cat_tensors(key, [part.batch[key] for part in parts]) for key in first._tensor_keys()}
            batch = TensorDict(tensors, batch_size=[sum(len(part) for part in parts)])
        non_tensors = {key: np.concatenate([part.non_tensor_batch[key] for part in parts])
                       for key in first.non_tensor_batch}
        return DataProto(batch, non_tensors, dict(first.meta_info))

    def repeat(self, num_repeats: int, interleave: bool = True) -> DataProto:
        """Each row `num_repeats` times: interleave gives a,a,b,b (samples per prompt), else a,b,a,b.

        Tensors are copied; non-tensor entries are the same Python objects repeated (not deep copies).
        """
        _check_positive_int("num_repeats", num_repeats)
        rows_B = np.arange(len(self), dtype=np.int64)
        rows_R = np.repeat(rows_B, num_repeats) if interleave else np.tile(rows_B, num_repeats)
        return self._take(rows_R)

    # ----------------------------------------------------------------------------------------------
    # Devices, sizes, printing
    # ----------------------------------------------------------------------------------------------

    def to(self, device: torch.device | str) -> DataProto:
        """A new DataProto with every tensor on `device` (non-tensors and meta_info shared), like Tensor.to."""
        batch = self.batch.to(device) if self.batch is not None else None
        return DataProto(batch, dict(self.non_tensor_batch), dict(self.meta_info))

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors plus an estimate of the non-tensor objects (sizes of the Python objects)."""
        total = sum(t.numel() * t.element_size() for t in (self.batch[k] for k in self._tensor_keys()))
        for array in self.non_tensor_batch.values():
            total += array.nbytes + sum(_object_nbytes(item) for item in array)
        return total

    def __repr__(self) -> str:
        fields = [f"{k}: {_describe_tensor(self.batch[k])}" for k in self._tensor_keys()]
        fields += [f"{k}: object[{len(v)}]" for k, v in self.non_tensor_batch.items()]
        return (f"DataProto(len={len(self)}, {{{', '.join(fields)}}}, "
                f"meta_info keys={list(self.meta_info)}, nbytes={self.nbytes})")

    # ----------------------------------------------------------------------------------------------
    # Transport: each tensor travels as one contiguous byte buffer
    # ----------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """Tensors as flat uint8 numpy arrays (pickle protocol 5 and Ray move them out-of-band, zero copy).

        uint8 works for every dtype numpy lacks (bf16, fp8); dtype and shape travel beside the bytes.
        Tensors arrive on CPU, detached: the receiving worker moves them to its own device.
        """
        tensors = {}
        for key in self._tensor_keys():
            tensor = self.batch[key].detach()
            flat_bytes = tensor.cpu().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)
            tensors[key] = (flat_bytes.numpy(), tensor.dtype, tuple(tensor.shape))
        return {
            "num_rows": len(self) if self.batch is not None else None,
            "tensors": tensors,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        self.batch = None
        if state["num_rows"] is not None:
            tensors = {}
            for key, (flat_bytes, dtype, shape) in state["tensors"].items():
                # Buffers from Ray's shared-memory store (and in-band pickles) are read-only; torch has no
                # read-only tensors and workers write into batches in place, so such a buffer is copied once.
                if not flat_bytes.flags.writeable:
                    flat_bytes = flat_bytes.copy()
                tensors[key] = torch.from_numpy(flat_bytes).view(dtype).view(shape)
            self.batch = TensorDict(tensors, batch_size=[state["num_rows"]])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _check_tensordict(batch: TensorDict) -> None:
    if not isinstance(batch, TensorDict):
        raise ValueError(f"batch must be a TensorDict (or use DataProto.from_dict), got {type(batch).__name__}")
    if len(batch.batch_size) != 1:
        raise ValueError(f"batch must have batch_size [B], got {list(batch.batch_size)}")
    for key in batch.keys():
        if not isinstance(key, str):
            raise ValueError(f"batch keys are strings, got {key!r}")
        if not isinstance(batch.get(key), torch.Tensor):
            raise ValueError(f"batch entry {key!r} is a {type(batch.get(key)).__name__}; the batch holds flat "
                             "tensors only (per-sample Python values go in non_tensor_batch)")


def _as_object_array(key: str, values: Any) -> np.ndarray:
    """Per-sample values as a 1-D numpy object array, one entry per sample."""
    if not isinstance(key, str):
        raise ValueError(f"keys are strings, got {type(key).__name__} {key!r}")
    if isinstance(values, torch.Tensor):
        raise ValueError(f"non-tensor {key!r} is a torch.Tensor; put tensors in the tensor batch")
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"non-tensor {key!r} has shape {values.shape}; non-tensors are 1-D arrays with one "
                             "object per sample (put numeric arrays in tensors with torch.as_tensor)")
        return values if values.dtype == object else values.astype(object)
    if isinstance(values, (str, bytes)) or not isinstance(values, collections.abc.Sequence):
        raise ValueError(f"non-tensor {key!r} must be a sequence with one entry per sample (list, tuple or 1-D "
                         f"numpy array), got {type(values).__name__}")
    # fromiter keeps each entry as one object; np.array would turn a list of lists into a 2-D array.
    return np.fromiter(values, dtype=object, count=len(values))


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _cat_tensors(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    for position, tensor in enumerate(tensors[1:], start=1):
        if tensor.dtype != first.dtype:
            raise ValueError(f"concat: tensor {key!r} is {first.dtype} in part 0 but {tensor.dtype} in part {position}")
        if tensor.shape[1:] != first.shape[1:]:
            raise ValueError(f"concat: tensor {key!r} has trailing shape {list(first.shape[1:])} in part 0 but "
                             f"{list(tensor.shape[1:])} in part {position}")
        if tensor.device != first.device:
            raise ValueError(f"concat: tensor {key!r} is on {first.device} in part 0 but {tensor.device} "
                             f"in part {position}")
    return torch.cat(tensors, dim=0)


def _describe_tensor(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)} {tensor.device}"


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for arbitrary per-sample or meta values, including tensors and arrays nested in them."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    result = a == b
    return bool(result) if isinstance(result, (bool, np.bool_)) else False


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))


def _object_nbytes(item: Any) -> int:
    """Approximate memory of one per-sample Python object (containers counted with their contents)."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return item.nbytes
    size = sys.getsizeof(item)
    if isinstance(item, dict):
        size += sum(_object_nbytes(k) + _object_nbytes(v) for k, v in item.items())
    elif isinstance(item, (list, tuple, set, frozenset)):
        size += sum(_object_nbytes(v) for v in item)
    return size
