"""Context.report (trainyard._rank) across a failover: a report that found no coordinator is kept
and sent before the next, and a coordinator of a new incarnation gets the recent reports again,
oldest first (issue 54). Pure logic: a stand-in for the stub, recording what it was sent."""
import grpc

import pytest

from trainyard import Context
from trainyard.v1 import trainer_pb2


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT


class Ended(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION


class Coordinators:
    """Answers ReportStep as the coordinator named by `incarnation` would; `down` fails calls."""

    def __init__(self):
        self.incarnation = "A"
        self.down = False
        self.refuse = False
        self.ended = False  # the attempt is no longer running
        self.sent = []  # (step, seq, the incarnation the report named)
        self.recorded = {}  # incarnation -> steps recorded, as the coordinator keeps them

    def ReportStep(self, report, **kwargs):
        if self.down:
            raise Unavailable()
        if self.refuse:
            raise Refused()
        if self.ended:
            raise Ended()
        self.sent.append((report.step, report.seq, report.incarnation))
        steps = self.recorded.setdefault(self.incarnation, [])
        if report.incarnation in ("", self.incarnation) and (not steps or report.seq > steps[-1][1]):
            steps.append((report.step, report.seq))
        return trainer_pb2.TrainerCommands(incarnation=self.incarnation)


def context(stub):
    ctx = Context(environ={"TRAINYARD_JOB_ID": "job-1", "TRAINYARD_JOB_CREDENTIAL": "c",
                           "RANK": "0", "WORLD_SIZE": "1", "TRAINYARD_COORDINATOR": "a:1"})
    ctx._stub = stub
    return ctx


def test_reports_missed_by_a_failover_reach_the_new_coordinator_once_and_in_order():
    coordinators = Coordinators()
    ctx = context(coordinators)
    ctx.report(1)
    ctx.report(2)
    coordinators.down = True  # the leader dies: reports 3 and 4 find nobody
    ctx.report(3)
    ctx.report(4)
    coordinators.down = False
    coordinators.incarnation = "B"  # a new leader, which has none of them
    ctx.report(5)
    assert coordinators.recorded["A"] == [(1, 1), (2, 2)]
    assert coordinators.recorded["B"] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    # Report 3 went first naming A (so B recorded nothing of it), then everything again.
    assert coordinators.sent[2] == (3, 3, "A")
    assert [step for step, _, inc in coordinators.sent[3:]] == [1, 2, 3, 4, 5]
    assert all(inc == "B" for _, _, inc in coordinators.sent[3:])
    ctx.report(6)
    assert coordinators.recorded["B"][-1] == (6, 6)
    assert coordinators.sent[-1] == (6, 6, "B")


def test_a_refused_report_is_raised_and_not_sent_again():
    coordinators = Coordinators()
    ctx = context(coordinators)
    ctx.report(1)
    coordinators.refuse = True
    with pytest.raises(grpc.RpcError):
        ctx.report(2)
    coordinators.refuse = False
    ctx.report(3)
    assert [step for step, _, _ in coordinators.sent] == [1, 3]


def test_a_report_after_the_attempt_ended_turns_into_a_stop_not_an_exception():
    coordinators = Coordinators()
    ctx = context(coordinators)
    ctx.report(1)
    assert not ctx.should_stop()
    coordinators.ended = True
    assert ctx.report(2) == {"checkpoint_requested": False, "stop_requested": True}
    assert ctx.should_stop() and ctx.checkpoint_requested()
    coordinators.ended = False
    ctx.report(3)  # what the ended attempt refused is not sent again
    assert [step for step, _, _ in coordinators.sent] == [1, 3]
