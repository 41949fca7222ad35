"""common/pooling.py: the client's names and the worker protocol's numbers."""

from __future__ import annotations

import pytest

from common.pooling import Pooling
from common.rpc import worker_pb2 as pb


def test_wire_numbers_are_the_protocol_s_and_names_parse():
    assert Pooling.MEAN.wire == pb.EmbedRequest.POOLING_MEAN == 0  # an older caller's default
    assert Pooling.LAST.wire == pb.EmbedRequest.POOLING_LAST
    assert [Pooling.from_wire(p.wire) for p in Pooling] == list(Pooling)
    assert [Pooling.parse(p.value) for p in Pooling] == list(Pooling)
    for number in (-1, len(Pooling), 7):
        with pytest.raises(ValueError, match=f"unknown pooling {number}"):
            Pooling.from_wire(number)
    for value in ("Last", "max", "", None, 1, ["last"]):
        with pytest.raises(ValueError, match="pooling must be one of 'mean', 'last'"):
            Pooling.parse(value)
