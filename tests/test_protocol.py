"""Tests of DataProto: keys, rows, padding round-trips, joins, repeats and zero-copy transport."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridflow.device import current_device
from hybridflow.protocol import DataProto, UnknownKeyError


def make_data(num_rows: int = 5, response_len: int = 3) -> DataProto:
    """Rows numbered 0..num_rows-1 in every field, so any row operation can be checked by value."""
    rows = torch.arange(num_rows)
    return DataProto.from_dict(
        tensors={
            "input_ids": rows[:, None] * 10 + torch.arange(response_len)[None, :],
            "logprobs": (rows.float()[:, None] / 4 + torch.zeros(response_len)).to(torch.bfloat16),
            "scores": rows.float() * 0.5,
        },
        non_tensors={
            "raw_prompt": [f"prompt {i}" for i in range(num_rows)],
            "extra": [{"id": i, "tags": [i, i + 1]} for i in range(num_rows)],
        },
        meta_info={"temperature": 0.7, "step": 3},
    )


def row_ids(data: DataProto) -> list[int]:
    """The source row number of every row, read from each field and checked to agree across fields."""
    ids = (data["input_ids"][:, 0] // 10).tolist()
    assert (data["logprobs"][:, 0].float() * 4).round().long().tolist() == ids
    assert (data["scores"] * 2).round().long().tolist() == ids
    assert list(data["raw_prompt"]) == [f"prompt {i}" for i in ids]
    assert [extra["id"] for extra in data["extra"]] == ids
    return ids


def assert_same(a: DataProto, b: DataProto) -> None:
    assert a.keys() == b.keys()
    for key in a._tensor_keys():
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key
    for key in a.non_tensor_batch:
        assert a[key].dtype == object and b[key].dtype == object
        assert list(a[key]) == list(b[key]), key
    assert a.meta_info == b.meta_info


# --------------------------------------------------------------------------------------------------
# Construction and validation
# --------------------------------------------------------------------------------------------------


def test_from_dict_exposes_len_keys_contains_and_values():
    data = make_data(5)
    assert len(data) == 5
    assert data.keys() == ["input_ids", "logprobs", "scores", "raw_prompt", "extra"]
    assert "input_ids" in data and "raw_prompt" in data and "temperature" not in data
    assert data["input_ids"][2].tolist() == [20, 21, 22]
    assert data["raw_prompt"][4] == "prompt 4"
    assert data["extra"][1] == {"id": 1, "tags": [1, 2]}
    assert data.get("missing", "default") == "default"
    assert data.meta_info == {"temperature": 0.7, "step": 3}


def test_empty_dataproto_has_zero_rows_and_no_keys():
    data = DataProto()
    assert len(data) == 0 and data.keys() == [] and data.meta_info == {}


def test_tensor_with_a_different_first_dimension_is_rejected_with_key_and_sizes():
    with pytest.raises(ValueError, match=r"'attention_mask' has 4 rows but tensor 'input_ids' has 5"):
        DataProto.from_dict({"input_ids": torch.zeros(5, 2), "attention_mask": torch.zeros(4, 2)})


def test_non_tensor_of_the_wrong_length_is_rejected_with_key_and_sizes():
    with pytest.raises(ValueError, match=r"non-tensor 'raw_prompt' has 3 rows but this DataProto has 5"):
        DataProto.from_dict({"input_ids": torch.zeros(5, 2)}, {"raw_prompt": ["a", "b", "c"]})


@pytest.mark.parametrize("value", ["a string", {"a": 1}, 3, torch.zeros(5)])
def test_non_tensor_values_that_are_not_per_sample_sequences_are_rejected(value):
    with pytest.raises(ValueError, match="non-tensor 'bad'"):
        DataProto.from_dict({"input_ids": torch.zeros(5, 2)}, {"bad": value})


def test_non_tensor_numpy_arrays_must_be_one_dimensional_and_become_object_arrays():
    with pytest.raises(ValueError, match=r"non-tensor 'grid' has shape \(5, 2\)"):
        DataProto.from_dict(non_tensors={"grid": np.zeros((5, 2))})
    data = DataProto.from_dict(non_tensors={"uid": np.arange(5), "name": np.array(["x", "yy", "z", "w", "v"])})
    assert data["uid"].dtype == object and data["uid"].tolist() == [0, 1, 2, 3, 4]
    assert data["name"].dtype == object and data["name"][1] == "yy"
    assert len(data) == 5


def test_a_list_of_lists_stays_one_entry_per_sample():
    data = DataProto.from_dict(non_tensors={"tool_calls": [[1, 2], [3, 4], [5, 6]]})
    assert data["tool_calls"].shape == (3,)
    assert data["tool_calls"][1] == [3, 4]


def test_scalar_tensor_nested_tensordict_and_bad_meta_info_are_rejected():
    with pytest.raises(ValueError, match="tensor 'x' is a scalar"):
        DataProto.from_dict({"x": torch.tensor(1.0)})
    nested = TensorDict({"inner": TensorDict({"a": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(ValueError, match="batch entry 'inner' is a TensorDict"):
        DataProto(batch=nested)
    with pytest.raises(ValueError, match=r"batch_size \[B\]"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(ValueError, match="meta_info must be a dict"):
        DataProto(meta_info=[1, 2])
    with pytest.raises(ValueError, match="'both' is both a tensor and a non-tensor"):
        DataProto(TensorDict({"both": torch.zeros(2)}, batch_size=[2]), {"both": ["a", "b"]})


def test_from_single_dict_sorts_tensors_from_per_sample_values():
    data = DataProto.from_single_dict({"ids": torch.arange(3), "text": ["a", "b", "c"]}, meta_info={"k": 1})
    assert data.batch is not None and list(data.batch.keys()) == ["ids"]
    assert list(data.non_tensor_batch) == ["text"] and data.meta_info == {"k": 1}


# --------------------------------------------------------------------------------------------------
# Setting and deleting keys
# --------------------------------------------------------------------------------------------------


def test_setitem_adds_tensors_and_non_tensors_with_row_validation():
    data = make_data(5)
    data["values"] = torch.ones(5, 3)
    data["answer"] = ["1", "2", "3", "4", "5"]
    assert data["values"].shape == (5, 3) and data["answer"][4] == "5"
    with pytest.raises(ValueError, match=r"tensor 'bad' has 4 rows but this DataProto has 5"):
        data["bad"] = torch.ones(4)
    with pytest.raises(ValueError, match=r"non-tensor 'bad' has 6 rows but this DataProto has 5"):
        data["bad"] = list(range(6))
    with pytest.raises(ValueError, match="non-tensor 'bad' must be a sequence"):
        data["bad"] = 3.0
    assert "bad" not in data


def test_setitem_replaces_a_key_of_the_other_kind_and_first_entry_defines_the_size():
    data = DataProto()
    data["ids"] = torch.arange(4)
    assert len(data) == 4
    data["ids"] = ["a", "b", "c", "d"]
    assert data.keys() == ["ids"] and data["ids"][2] == "c"
    data["ids"] = torch.arange(7)  # it is the only key, so it may change the size
    assert len(data) == 7 and data.keys() == ["ids"]


def test_delitem_removes_either_kind_and_unknown_keys_raise():
    data = make_data(3)
    del data["scores"]
    del data["extra"]
    assert data.keys() == ["input_ids", "logprobs", "raw_prompt"]
    with pytest.raises(UnknownKeyError):
        del data["scores"]


def test_unknown_key_lookup_is_both_keyerror_and_valueerror_listing_available_keys():
    data = make_data(2)
    with pytest.raises(KeyError):
        data["nope"]
    with pytest.raises(ValueError, match=r"unknown key 'nope'; available: tensors \['input_ids', 'logprobs', "
                                         r"'scores'\], non-tensors \['raw_prompt', 'extra'\]"):
        data["nope"]


# --------------------------------------------------------------------------------------------------
# Rows: indexing, slicing, reorder
# --------------------------------------------------------------------------------------------------


def test_int_index_gives_a_one_row_dataproto_and_negative_ints_count_from_the_end():
    data = make_data(5)
    assert len(data[2]) == 1 and row_ids(data[2]) == [2]
    assert row_ids(data[-1]) == [4]
    assert data[np.int64(3)].meta_info == data.meta_info
    with pytest.raises(IndexError, match="row 5 is out of range for a DataProto of 5 rows"):
        data[5]
    with pytest.raises(IndexError):
        data[-6]


def test_slices_select_rows_with_steps_and_are_views():
    data = make_data(6)
    assert row_ids(data[1:4]) == [1, 2, 3]
    assert row_ids(data[::2]) == [0, 2, 4]
    assert row_ids(data[4:100]) == [4, 5]
    view = data[1:3]
    view["input_ids"][0, 0] = 999
    assert data["input_ids"][1, 0].item() == 999


@pytest.mark.parametrize("index", [[4, 0, 0], np.array([4, 0, 0]), torch.tensor([4, 0, 0]), [-1, 0, -5]])
def test_integer_lists_arrays_and_tensors_gather_rows_in_the_given_order(index):
    gathered = make_data(5)[index]
    assert row_ids(gathered) == [4, 0, 0]
    assert gathered.meta_info == {"temperature": 0.7, "step": 3}


def test_boolean_masks_select_rows_and_must_match_the_length():
    data = make_data(5)
    mask = [True, False, True, False, True]
    assert row_ids(data[torch.tensor(mask)]) == [0, 2, 4]
    assert row_ids(data[np.array(mask)]) == [0, 2, 4]
    with pytest.raises(ValueError, match="boolean mask has 3 entries but the DataProto has 5 rows"):
        data[torch.tensor([True, False, True])]


def test_gathered_rows_are_copies_and_bad_indices_raise():
    data = make_data(5)
    copy = data[[1, 2]]
    copy["input_ids"][0, 0] = 999
    assert data["input_ids"][1, 0].item() == 10
    assert len(data[[]]) == 0 and data[[]].keys() == data.keys()
    with pytest.raises(IndexError, match="row 7 is out of range"):
        data[[0, 7]]
    with pytest.raises(TypeError, match="integers or booleans"):
        data[np.array([0.0, 1.0])]
    with pytest.raises(TypeError, match="cannot index a DataProto with float"):
        data[1.5]


def test_reorder_permutes_rows_in_place_and_requires_a_permutation():
    data = make_data(4)
    data.reorder(torch.tensor([3, 1, 0, 2]))
    assert row_ids(data) == [3, 1, 0, 2]
    with pytest.raises(ValueError, match=r"reorder needs a permutation of range\(4\)"):
        data.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match=r"permutation of range\(4\), got 3 indices"):
        data.reorder([0, 1, 2])


def test_iterating_yields_one_row_dataprotos():
    assert [row_ids(row) for row in make_data(3)] == [[0], [1], [2]]


# --------------------------------------------------------------------------------------------------
# Keys: select, pop, union
# --------------------------------------------------------------------------------------------------


def test_select_keeps_only_named_keys_shares_tensors_and_copies_meta_info():
    data = make_data(4)
    picked = data.select(batch_keys=["input_ids"], non_tensor_keys=["raw_prompt"], meta_keys=["step"])
    assert picked.keys() == ["input_ids", "raw_prompt"] and picked.meta_info == {"step": 3}
    assert picked["input_ids"] is data["input_ids"]
    everything = data.select()
    assert everything.keys() == data.keys() and everything.meta_info == data.meta_info
    everything.meta_info["step"] = 4
    assert data.meta_info["step"] == 3
    only_strings = data.select(batch_keys=[])
    assert only_strings.keys() == ["raw_prompt", "extra"] and len(only_strings) == 4


def test_select_and_pop_reject_unknown_keys_listing_the_available_ones():
    data = make_data(2)
    with pytest.raises(ValueError, match=r"unknown key 'values' in batch_keys; available: "
                                         r"\['input_ids', 'logprobs', 'scores'\]"):
        data.select(batch_keys=["values"])
    with pytest.raises(ValueError, match=r"unknown key 'x' in non_tensor_keys; available: \['raw_prompt', 'extra'\]"):
        data.pop(non_tensor_keys=["x"])
    with pytest.raises(ValueError, match=r"unknown key 'lr' in meta_keys; available: \['temperature', 'step'\]"):
        data.select(meta_keys=["lr"])
    with pytest.raises(ValueError, match=r"must be a list of key names, got the string 'input_ids'"):
        data.select(batch_keys="input_ids")
    assert data.keys() == make_data(2).keys()


def test_pop_removes_the_named_keys_from_self_and_returns_them():
    data = make_data(3)
    popped = data.pop(batch_keys=["scores"], non_tensor_keys=["extra"], meta_keys=["temperature"])
    assert popped.keys() == ["scores", "extra"] and popped.meta_info == {"temperature": 0.7}
    assert popped["scores"].tolist() == [0.0, 0.5, 1.0]
    assert data.keys() == ["input_ids", "logprobs", "raw_prompt"] and data.meta_info == {"step": 3}
    nothing = data.pop()
    assert nothing.keys() == [] and len(nothing) == 3 and data.keys() == ["input_ids", "logprobs", "raw_prompt"]


def test_union_merges_keys_and_accepts_equal_duplicates():
    data = make_data(3)
    left = data.select(batch_keys=["input_ids"], non_tensor_keys=["raw_prompt"], meta_keys=["step"])
    right = data.select(batch_keys=["input_ids", "scores"], non_tensor_keys=["extra"], meta_keys=["temperature"])
    merged = left.union(right)
    assert merged.keys() == ["input_ids", "scores", "raw_prompt", "extra"]
    assert merged.meta_info == {"step": 3, "temperature": 0.7}
    assert row_ids(merged.union(data)) == [0, 1, 2]
    assert left.keys() == ["input_ids", "raw_prompt"], "union must not modify its operands"
    assert merged.union(DataProto(meta_info={"epoch": 1})).meta_info["epoch"] == 1


def test_union_rejects_conflicting_values_naming_the_key():
    data = make_data(3)
    other = make_data(3)
    other["scores"] = other["scores"] + 1
    with pytest.raises(ValueError, match="union conflict on tensor 'scores'"):
        data.union(other.select(batch_keys=["scores"]))
    other = make_data(3)
    other["extra"] = [{"id": 0}, {"id": 1}, {"id": 2}]
    with pytest.raises(ValueError, match="union conflict on non-tensor 'extra'"):
        data.union(other.select(batch_keys=[], non_tensor_keys=["extra"]))
    with pytest.raises(ValueError, match="union conflict on meta_info 'step': 3 vs 4"):
        data.union(DataProto(meta_info={"step": 4}))
    half = data.select()
    half["scores"] = half["scores"].half()
    with pytest.raises(ValueError, match=r"'scores'.*float32\[3\] cpu vs float16\[3\] cpu"):
        data.union(half)


def test_union_of_different_sizes_names_both_sizes():
    with pytest.raises(ValueError, match="different sizes: 3 rows and 4 rows"):
        make_data(3).union(make_data(4))


# --------------------------------------------------------------------------------------------------
# Padding, chunk, split, concat
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_rows", "num_chunks", "expected_pad_rows"),
                         [(10, 4, [0, 1]), (3, 8, [0, 1, 2, 0, 1]), (8, 4, []), (1, 3, [0, 0]), (7, 1, [])])
def test_pad_chunk_concat_unpad_round_trips_exactly(num_rows, num_chunks, expected_pad_rows):
    data = make_data(num_rows)
    padded, pad_size = data.pad_to_multiple(num_chunks)
    assert pad_size == len(expected_pad_rows)
    assert row_ids(padded) == list(range(num_rows)) + expected_pad_rows
    chunks = padded.chunk(num_chunks)
    assert len(chunks) == num_chunks
    assert {len(chunk) for chunk in chunks} == {len(padded) // num_chunks}
    assert all(chunk.meta_info == data.meta_info for chunk in chunks)
    restored = DataProto.concat(chunks).unpad(pad_size)
    assert_same(restored, data)


def test_chunk_pads_by_itself_when_not_divisible():
    chunks = make_data(10).chunk(4)
    assert [row_ids(chunk) for chunk in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]


def test_padding_arguments_are_validated():
    data = make_data(3)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_chunks must be a positive int"):
            data.chunk(bad)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, 3\], got 4"):
        data.unpad(4)
    empty_padded, empty_pad_size = make_data(3)[[]].pad_to_multiple(2)
    assert len(empty_padded) == 0 and empty_pad_size == 0
    assert [len(chunk) for chunk in make_data(4)[[]].chunk(2)] == [0, 0]


def test_split_gives_consecutive_pieces_with_a_shorter_last_one():
    data = make_data(10)
    pieces = data.split(4)
    assert [row_ids(piece) for piece in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert_same(DataProto.concat(pieces), data)
    with pytest.raises(ValueError, match="rows_per_split must be a positive int, got 0"):
        data.split(0)


def test_concat_keeps_the_first_meta_info_and_joins_non_tensors():
    first, second = make_data(2), make_data(3)[[2]]
    second.meta_info = {"other": True}
    joined = DataProto.concat([first, second])
    assert row_ids(joined) == [0, 1, 2] and joined.meta_info == first.meta_info
    strings_only = DataProto.concat([DataProto.from_dict(non_tensors={"s": ["a"]}),
                                     DataProto.from_dict(non_tensors={"s": ["b", "c"]})])
    assert strings_only.batch is None and list(strings_only["s"]) == ["a", "b", "c"]


def test_concat_rejects_mismatched_keys_dtypes_and_shapes_naming_the_key():
    data = make_data(3)
    with pytest.raises(ValueError, match=r"tensor key\(s\) \['scores'\] are in part 0 or part 1 but not both"):
        DataProto.concat([data, data.select(batch_keys=["input_ids", "logprobs"])])
    with pytest.raises(ValueError, match=r"non-tensor key\(s\) \['extra'\]"):
        DataProto.concat([data, data.select(non_tensor_keys=["raw_prompt"])])
    other = make_data(3)
    other["scores"] = other["scores"].double()
    with pytest.raises(ValueError, match="tensor 'scores' is torch.float32 in part 0 but torch.float64 in part 1"):
        DataProto.concat([data, other])
    wider = make_data(3, response_len=4)
    with pytest.raises(ValueError, match=r"tensor 'input_ids' has trailing shape \[3\] in part 0 but \[4\] in part 2"):
        DataProto.concat([data, data, wider])
    with pytest.raises(ValueError, match="at least one DataProto"):
        DataProto.concat([])


# --------------------------------------------------------------------------------------------------
# repeat, to, nbytes, repr
# --------------------------------------------------------------------------------------------------


def test_repeat_interleaved_gives_samples_per_prompt_side_by_side():
    repeated = make_data(3).repeat(2)
    assert row_ids(repeated) == [0, 0, 1, 1, 2, 2]
    assert repeated["input_ids"][:, 2].tolist() == [2, 2, 12, 12, 22, 22]


def test_repeat_without_interleave_tiles_the_whole_batch():
    assert row_ids(make_data(3).repeat(3, interleave=False)) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert row_ids(make_data(3).repeat(1)) == [0, 1, 2]
    with pytest.raises(ValueError, match="num_repeats must be a positive int, got 0"):
        make_data(3).repeat(0)


def test_to_returns_a_new_dataproto_on_the_device_without_touching_self():
    data = make_data(2)
    device = current_device()
    moved = data.to(device)
    assert moved is not data and moved["input_ids"].device == device
    assert_same(moved.to("cpu"), data)
    moved.meta_info["step"] = 5
    assert data.meta_info["step"] == 3


def test_tensors_on_the_compute_device_arrive_on_cpu_after_pickling():
    data = make_data(3)
    restored = pickle.loads(pickle.dumps(data.to(current_device()), protocol=5))
    assert restored["logprobs"].device.type == "cpu"
    assert_same(restored, data)


def test_nbytes_counts_tensor_bytes_exactly_and_estimates_objects():
    tensors_only = make_data(4).select(non_tensor_keys=[])
    assert tensors_only.nbytes == 4 * 3 * 8 + 4 * 3 * 2 + 4 * 4
    strings = DataProto.from_dict(non_tensors={"s": ["x" * 1000] * 2})
    assert 2000 <= strings.nbytes <= 2000 + 2 * 200 + 64


def test_repr_shows_keys_shapes_and_dtypes():
    text = repr(make_data(4))
    for piece in ("len=4", "input_ids: int64[4, 3] cpu", "logprobs: bfloat16[4, 3] cpu", "raw_prompt: object[4]",
                  "meta_info keys=['temperature', 'step']"):
        assert piece in text


# --------------------------------------------------------------------------------------------------
# Transport
# --------------------------------------------------------------------------------------------------


def pickle_out_of_band(data: DataProto) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    return payload, buffers


def test_large_batch_pickles_into_one_buffer_per_tensor_near_the_raw_size():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 50_000, (256, 2048), generator=generator)
    data = DataProto.from_dict({"input_ids": input_ids}, meta_info={"step": 1})
    payload, buffers = pickle_out_of_band(data)
    raw_bytes = input_ids.numel() * 8
    assert len(buffers) == 1 and buffers[0].raw().nbytes == raw_bytes
    assert len(payload) < 1024, "only metadata travels in-band"
    assert (len(payload) + raw_bytes) / raw_bytes < 1.01
    restored = pickle.loads(payload, buffers=buffers)
    assert_same(restored, data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int32, torch.float64])
def test_every_dtype_round_trips_exactly_through_pickle(dtype):
    values = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) * 100
    data = make_data(6)
    data["x"] = values.to(dtype)
    data["strided"] = values.to(dtype).t().contiguous().t()[::1]  # non-contiguous layout
    data["empty"] = torch.zeros(6, 0, dtype=dtype)
    for protocol in (4, 5):
        restored = pickle.loads(pickle.dumps(data, protocol=protocol))
        assert_same(restored, data)
    payload, buffers = pickle_out_of_band(data)
    assert_same(pickle.loads(payload, buffers=buffers), data)


def test_unpickled_tensors_are_writable_and_detached():
    data = DataProto.from_dict({"w": torch.ones(3, 2, requires_grad=True)})
    restored = pickle.loads(pickle.dumps(data, protocol=4))  # in-band: numpy sees read-only bytes
    assert not restored["w"].requires_grad
    restored["w"][0, 0] = 5.0
    assert restored["w"][0, 0].item() == 5.0 and data["w"][0, 0].item() == 1.0


def test_dataproto_round_trips_through_the_ray_object_store(ray_session):
    data = make_data(4)
    data["big"] = torch.arange(4 * 4096, dtype=torch.bfloat16).view(4, 4096)
    restored = ray_session.get(ray_session.put(data))
    assert_same(restored, data)
    restored["big"][0, 0] = 7.0  # the shared-memory buffer was copied into a writable tensor
    assert restored["big"][0, 0].item() == 7.0


def test_deepcopy_gives_an_independent_dataproto():
    data = make_data(3)
    clone = copy.deepcopy(data)
    clone["logprobs"][0, 0] = 9.0
    clone["extra"][0]["id"] = 99
    clone.meta_info["step"] = 4
    assert_same(data, make_data(3))
    assert clone["logprobs"].dtype == torch.bfloat16 and clone["logprobs"][0, 0].item() == 9.0
