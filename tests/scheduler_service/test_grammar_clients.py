"""Whom a call's grammar compiles count against (``client_of``): its API key
(as a digest, never the key), else the peer's address without its port."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.api.grammar_check import client_of


@dataclass
class CallContext:
    """What ``client_of`` reads of a grpc.aio ServicerContext."""

    peer_: str
    metadata: tuple = ()

    def peer(self) -> str:
        return self.peer_

    def invocation_metadata(self) -> tuple:
        return self.metadata


def test_calls_from_one_address_are_one_client_whatever_their_port():
    a = client_of(CallContext("ipv4:10.0.0.7:51234"))
    assert a == client_of(CallContext("ipv4:10.0.0.7:40000")) == "10.0.0.7"
    assert client_of(CallContext("ipv4:10.0.0.8:51234")) != a
    assert client_of(CallContext("ipv6:[2001:db8::1]:443")) == "2001:db8::1"


def test_an_api_key_is_the_client_wherever_it_calls_from():
    key = (("authorization", "Bearer s3cret"),)
    a = client_of(CallContext("ipv4:10.0.0.7:1", key))
    assert a == client_of(CallContext("ipv4:10.0.0.9:2", key))
    assert a != client_of(CallContext("ipv4:10.0.0.7:1", (("authorization", "Bearer other"),)))
    assert "s3cret" not in a  # a digest: the key itself is never kept
