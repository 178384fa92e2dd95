"""Endpoints.follow (trainyard._channel): where a client goes after a failed call, the same rules
as yard's (common/coordinator_endpoints.h). Pure logic, with stand-ins for gRPC's errors."""
import grpc

from trainyard._channel import Endpoints


class Error(grpc.RpcError):
    def __init__(self, code, leader=None):
        self._code = code
        self._trailers = (("trainyard-leader", leader),) if leader is not None else ()

    def code(self):
        return self._code

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
