"""Channels to the coordinator, as yard and the ranks open them."""
import os

import grpc

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
