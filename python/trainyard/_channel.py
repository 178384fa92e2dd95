"""Channels to the coordinator, as yard and the ranks open them, and following its leader among
replicas (common/coordinator_endpoints.h on the C++ side)."""
import os
import time

import grpc

# How the message of a stream the coordinator ended for falling behind begins (RESOURCE_EXHAUSTED;
# common/coordinator_endpoints.h's kFellBehind): read again from the start, dropping what was had.
FELL_BEHIND = "the stream's reader fell more than "
# Trailing metadata of a standby replica's UNAVAILABLE: the leader's HOST:PORT.
LEADER_METADATA = "trainyard-leader"

# Large enough for a page of jobs (the coordinator's default cap is 4 MiB).
_OPTIONS = [("grpc.max_receive_message_length", 8 << 20)]


def open_channel(address, tls_ca=None):
    """A channel to `address` (HOST:PORT): TLS verified against the PEM file `tls_ca`, else (and
    when TRAINYARD_TLS_CA is unset or empty) plaintext, as yard does."""
    ca = tls_ca if tls_ca is not None else os.environ.get("TRAINYARD_TLS_CA", "")
    if ca:
        with open(ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(address, credentials, options=_OPTIONS)
    return grpc.insecure_channel(address, options=_OPTIONS)


def bearer(token):
    return (("authorization", "Bearer " + token),)


def _is_host_port(text):
    colon = text.rfind(":")
    return (0 < len(text) <= 300 and 0 < colon < len(text) - 1 and
            all(" " < c < "\x7f" and c != "," for c in text))


class Endpoints:
    """The coordinator replicas a client may call ("a:7070" or "a:7070,b:7070"), and the channel
    to the one in use. After a failed call, `follow` moves to the leader a standby named, or down
    the list when nobody answered (UNAVAILABLE without a name, DEADLINE_EXCEEDED)."""

    def __init__(self, addresses, tls_ca=None):
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()] or [addresses]
        self._tls_ca = tls_ca
        self._index = 0
        self.channel = open_channel(self.current, tls_ca)

    @property
    def current(self):
        return self.addresses[self._index]

    def follow(self, error):
        """True when the address in use changed (a new channel is open), or when a standby that
        knows no leader yet should be asked again."""
        code = error.code() if hasattr(error, "code") else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False
        trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
        named = LEADER_METADATA in trailers
        leader = trailers.get(LEADER_METADATA, "")
        if not _is_host_port(leader):
            leader = ""  # (from the server: only one printable HOST:PORT is used)
        if leader:
            if leader == self.current:
                return True  # it is taking over: ask again
            if leader not in self.addresses and len(self.addresses) < 16:
                self.addresses.append(leader)
            self._move(self.addresses.index(leader))
            return True
        if len(self.addresses) > 1:
            self._move((self._index + 1) % len(self.addresses))
            return True
        return named

    def _move(self, index):
        self.channel.close()
        self._index = index
        self.channel = open_channel(self.current, self._tls_ca)


class FollowingStub:
    """A stub whose unary calls follow the leader (Endpoints.follow) for up to `follow_for`
    seconds, pausing longer while nobody answers. Server streams follow it through stream()."""

    def __init__(self, endpoints, stub_class, follow_for=30.0):
        self._endpoints = endpoints
        self._stub_class = stub_class
        self._follow_for = follow_for

    def __getattr__(self, name):
        def call(request, **kwargs):
            give_up = time.monotonic() + self._follow_for
            attempt = 0
            while True:
                method = getattr(self._stub_class(self._endpoints.channel), name)
                try:
                    return method(request, **kwargs)
                except grpc.RpcError as error:
                    if time.monotonic() > give_up or not self._endpoints.follow(error):
                        raise
                    time.sleep(min(0.1 * (2 ** min(attempt, 4)), 1.0))
                    attempt += 1

        return call

    def stream(self, name, request, seen=None, resume_request=None, **kwargs):
        """Server stream `name`, as a generator that follows the leader as unary calls do while it
        fails before its first message. With `seen` (True for a message already yielded), also
        when the leader goes away under it (UNAVAILABLE: a failover under `logs(follow=True)`), or
        ended it for falling behind (a consumer slower than the job's output): it is opened again
        at the leader with `resume_request` (default: `request`), from its start, and `seen`
        drops what was yielded before."""
        give_up = time.monotonic() + self._follow_for
        attempt = 0
        while True:
            call = getattr(self._stub_class(self._endpoints.channel), name)(request, **kwargs)
            got = False
            try:
                for message in call:
                    # (Not a log position: a stream that breaks among them opens as it was.)
                    got = got or not getattr(message, "position", False)
                    if seen is None or not seen(message):
                        yield message
                return
            except grpc.RpcError as error:
                if (got and seen is not None and
                        error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and
                        (error.details() or "").startswith(FELL_BEHIND)):
                    # Read again (it read something: it moves on), after a second: a consumer that
                    # stays slower than the job prints costs the coordinator a replay a second.
                    request = resume_request if resume_request is not None else request
                    give_up = time.monotonic() + self._follow_for
                    attempt = 0
                    time.sleep(1.0)
                    continue
                resumed = (got and seen is not None and
                           error.code() == grpc.StatusCode.UNAVAILABLE)
                if got and not resumed:
                    raise
                if resumed:
                    give_up = time.monotonic() + self._follow_for
                    attempt = 0
                    request = resume_request if resume_request is not None else request
                if time.monotonic() > give_up or not self._endpoints.follow(error):
                    raise
                time.sleep(min(0.1 * (2 ** min(attempt, 4)), 1.0))
                attempt += 1
            finally:
                call.cancel()  # (a no-op once it ended; a consumer that stopped early ends it)
