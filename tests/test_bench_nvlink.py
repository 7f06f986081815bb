"""``bench nvlink``'s flag plan: which (copy, SMs, fanout) rows it times, and bad flags named."""

from __future__ import annotations

import argparse

import pytest

from uccl_ep_megatron.bench import nvlink
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError


def _args(**over):
    p = argparse.ArgumentParser()
    nvlink.add_arguments(p)
    a = p.parse_args([])
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_rows_cover_every_copy_and_budget_and_the_copy_engines_once_per_fanout():
    devices, rows = nvlink.plan(_args(sms="12,24", fanout="1,3"), num_gpus=4)
    assert devices == [0, 1, 2, 3]
    expect = [(m, s, f) for f in (1, 3) for m in ("ldst", "tma") for s in (12, 24)]
    expect += [("ce", 0, 1), ("ce", 0, 3)]
    assert sorted(rows) == sorted(expect)
    assert len(rows) == len(set(rows))


def test_a_value_given_twice_is_timed_once():
    _, rows = nvlink.plan(_args(modes="ldst,ldst", sms="12,12", fanout="1,1"), num_gpus=2)
    assert rows == [("ldst", 12, 1)]


def test_a_bad_flag_is_named_before_the_missing_gpus():
    with pytest.raises(InvalidInputError, match="--sms='0'"):
        nvlink.plan(_args(sms="0"), num_gpus=0)


def test_chosen_gpus_are_kept_in_order():
    devices, _ = nvlink.plan(_args(gpus="3,1"), num_gpus=4)
    assert devices == [3, 1]


@pytest.mark.parametrize(
    "over, gpus, named, err",
    [
        ({"gpus": "0"}, 4, "--gpus='0'", InvalidInputError),
        ({"gpus": "1,1"}, 4, "--gpus='1,1'", InvalidInputError),
        ({"gpus": "0,5"}, 4, "has 4 CUDA devices", UnsupportedError),
        ({}, 1, "bench nvlink needs two or more GPUs; this machine has 1", UnsupportedError),
        ({}, 0, "this machine has 0", UnsupportedError),
        ({"fanout": "2"}, 2, "--fanout='2'", InvalidInputError),
        ({"fanout": "0"}, 4, "--fanout='0'", InvalidInputError),
        ({"modes": "nccl"}, 4, "--modes='nccl'", InvalidInputError),
        ({"sms": "0"}, 4, "--sms='0'", InvalidInputError),
        ({"hidden": 7170}, 4, "--hidden=7170", InvalidInputError),
        ({"tokens": 0}, 4, "--tokens=0", InvalidInputError),
    ],
)
def test_bad_flags_are_named(over, gpus, named, err):
    with pytest.raises(err, match=named.replace("(", r"\(")):
        nvlink.plan(_args(**over), num_gpus=gpus)
