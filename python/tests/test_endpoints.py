"""Endpoints.follow (trainyard._channel): where a client goes after a failed call, the same rules
as yard's (common/coordinator_endpoints.h). Pure logic, with stand-ins for gRPC's errors."""
import grpc

import pytest

from trainyard import Client
from trainyard._channel import Endpoints


class Error(grpc.RpcError):
    def __init__(self, code, leader=None, details=""):
        self._code = code
        self._details = details
        self._trailers = (("trainyard-leader", leader),) if leader is not None else ()

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_a_standby_sends_the_client_to_the_leader_it_names():
    e = Endpoints("10.0.0.1:7070,10.0.0.2:7070")
    assert e.follow(Error(grpc.StatusCode.UNAVAILABLE, "10.0.0.2:7070"))
    assert e.current == "10.0.0.2:7070"
    # A leader outside the list (its advertised address) is added and used.
    assert e.follow(Error(grpc.StatusCode.UNAVAILABLE, "ctl-3:7070"))
    assert e.current == "ctl-3:7070"
    assert e.addresses == ["10.0.0.1:7070", "10.0.0.2:7070", "ctl-3:7070"]


def test_nobody_answering_moves_down_the_list_and_round():
    e = Endpoints("a:1, b:2")
    assert e.addresses == ["a:1", "b:2"]
    assert e.follow(Error(grpc.StatusCode.UNAVAILABLE))
    assert e.current == "b:2"
    assert e.follow(Error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert e.current == "a:1"


def test_other_errors_and_a_lone_address_stay_put():
    e = Endpoints("a:1,b:2")
    assert not e.follow(Error(grpc.StatusCode.PERMISSION_DENIED))
    assert not e.follow(Error(grpc.StatusCode.INVALID_ARGUMENT, "b:2"))
    assert e.current == "a:1"
    lone = Endpoints("a:1")
    assert not lone.follow(Error(grpc.StatusCode.UNAVAILABLE))
    # A standby that knows no leader yet: ask it again.
    assert lone.follow(Error(grpc.StatusCode.UNAVAILABLE, ""))
    assert lone.current == "a:1"


def test_a_name_that_is_not_one_host_and_port_is_taken_as_none():
    e = Endpoints("a:1,b:2")
    for bad in ("c:3\nforged", "c:3,d:4", "no-port", "x" * 400):
        assert e.follow(Error(grpc.StatusCode.UNAVAILABLE, bad))
    assert e.addresses == ["a:1", "b:2"]


def test_the_client_refuses_to_send_its_token_in_clear_to_another_host(monkeypatch):
    # (No call is made: gRPC's channels connect on their first call, and none is made here.)
    monkeypatch.delenv("TRAINYARD_TLS_CA", raising=False)
    monkeypatch.delenv("TRAINYARD_INSECURE", raising=False)
    for remote in ("192.0.2.1:7070", "coordinator.example:7070", "127.0.0.1:7070,192.0.2.1:7070",
                   "[::ffff:127.0.0.1]:7070"):
        with pytest.raises(ValueError, match="refusing to send your API token in clear"):
            Client(remote, token="tyk.x")
    for local in ("127.0.0.1:7070", "localhost:7070", "[::1]:7070", "127.0.0.1:1,127.0.0.2:2"):
        Client(local, token="tyk.x").close()
    Client("192.0.2.1:7070", token="tyk.x", insecure=True).close()
    monkeypatch.setenv("TRAINYARD_INSECURE", "1")
    Client("192.0.2.1:7070", token="tyk.x").close()


class _Line:
    def __init__(self, seq, attempt=1, rank=0, position=False):
        self.seq, self.attempt, self.rank, self.position = seq, attempt, rank, position


class _Call:
    """A server stream's call as gRPC returns it: iterable, cancellable; it may end in `error`."""

    def __init__(self, messages, error=None):
        self._messages, self._error, self.cancelled = messages, error, False

    def __iter__(self):
        yield from self._messages
        if self._error is not None:
            raise self._error

    def cancel(self):
        self.cancelled = True


def _stub_class(calls, requests):
    class Stub:
        def __init__(self, channel):
            pass

        def StreamLogs(self, request, **kwargs):
            requests.append(request)
            return calls.pop(0)

    return Stub


def test_a_stream_the_leader_dropped_goes_on_at_the_next_one_each_line_once():
    from trainyard._channel import FollowingStub
    from trainyard._client import _Seen

    calls = [_Call([_Line(1), _Line(2), _Line(3)], Error(grpc.StatusCode.UNAVAILABLE)),
             _Call([_Line(2), _Line(3), _Line(4), _Line(1, rank=1), _Line(0), _Line(5)])]
    requests = []
    stub = FollowingStub(Endpoints("a:1,b:2"), _stub_class(calls, requests))
    got = [(line.rank, line.seq) for line in
           stub.stream("StreamLogs", "first", seen=_Seen(), resume_request="again")]
    assert got == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (0, 0), (0, 5)]
    assert requests == ["first", "again"]
    assert stub._endpoints.current == "b:2"


def test_a_stream_ended_for_falling_behind_is_read_again_each_line_once():
    from trainyard._channel import FollowingStub
    from trainyard._client import _Seen

    behind = Error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   details="the stream's reader fell more than 16 MiB behind; read it again")
    calls = [_Call([_Line(1), _Line(2)], behind), _Call([_Line(1), _Line(2), _Line(3)])]
    requests = []
    stub = FollowingStub(Endpoints("a:1,b:2"), _stub_class(calls, requests))
    got = [line.seq for line in stub.stream("StreamLogs", "first", seen=_Seen(),
                                             resume_request="again")]
    assert got == [1, 2, 3]
    assert requests == ["first", "again"]
    assert stub._endpoints.current == "a:1", "the same leader: nothing moved"
    # Another RESOURCE_EXHAUSTED (a cap on streams) is the caller's: reading again would meet it.
    capped = Error(grpc.StatusCode.RESOURCE_EXHAUSTED, details="StreamLogs: you have 32 streams")
    stub = FollowingStub(Endpoints("a:1"), _stub_class([_Call([_Line(1)], capped)], []))
    with pytest.raises(grpc.RpcError):
        list(stub.stream("StreamLogs", "first", seen=_Seen()))


def test_a_tailed_stream_read_again_yields_no_line_the_tail_left_out():
    from trainyard._channel import FollowingStub
    from trainyard._client import _Seen

    # Each rank's position (where what the tail left out ends: rank 0's first two lines, rank 1's
    # two), then the tail (rank 0's last two lines). Read again from the first line after a
    # failover, only what came since (rank 0's 5, rank 1's 3) is new.
    first = [_Line(2, position=True), _Line(2, rank=1, position=True), _Line(3), _Line(4)]
    again = [_Line(1, rank=1), _Line(1), _Line(2), _Line(2, rank=1), _Line(3), _Line(4),
             _Line(5), _Line(3, rank=1)]
    calls = [_Call(first, Error(grpc.StatusCode.UNAVAILABLE)), _Call(again)]
    stub = FollowingStub(Endpoints("a:1,b:2"), _stub_class(calls, []))
    got = [(line.rank, line.seq) for line in
           stub.stream("StreamLogs", "first", seen=_Seen(), resume_request="again")]
    assert got == [(0, 3), (0, 4), (0, 5), (1, 3)]


def test_a_stream_without_a_way_to_drop_copies_fails_where_it_broke():
    from trainyard._channel import FollowingStub

    broken = _Call([_Line(1)], Error(grpc.StatusCode.UNAVAILABLE))
    stub = FollowingStub(Endpoints("a:1,b:2"), _stub_class([broken], []))
    got = []
    with pytest.raises(grpc.RpcError):
        for line in stub.stream("StreamLogs", "first"):
            got.append(line.seq)
    assert got == [1]
    assert broken.cancelled
