"""The public API's request fields, read from the descriptors of
SglangScheduler's methods, and the kinds of row the conformance table
(public_field_table.py) gives each: an effect checked against a running
server (``Here``), an effect checked by a named test elsewhere
(``Elsewhere``), a refusal (``Refused``), or, only while the branch that
gives it one is in flight, ``Pending``.

A field is named by its path from the request message
(``GenerateRequest.sampling_params.top_k``). Message fields of the public
packages are walked into, except where a row covers a whole message
(``Refused(whole=True)``, say ``GenerateRequest.mm_inputs``, or a request
message itself, ``EmbedRequest``); map fields and google.protobuf messages
(``custom_params``, ``timestamp``) are fields of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
PUBLIC_PACKAGES = ("sglang.grpc.scheduler.", "smg.grpc.common.")


@dataclass(frozen=True)
class Server:
    """A running radixserve: its public address and its metrics port."""

    address: str
    metrics_port: int | None = None


@dataclass(frozen=True)
class Here:
    """Its effect, checked against a running server: ``check(server)``
    raises if the field does nothing (or the wrong thing). ``model``: the
    server it needs, "simulated" or "default" (the real model, where meaning
    matters)."""

    check: Callable[[Server], None]
    model: str = "simulated"
    # the check covers every field under this path (a message the server
    # reads nothing of, say EmbedRequest.sampling_params)
    whole: bool = False


@dataclass(frozen=True)
class Elsewhere:
    """Its effect, checked by the test ``path::function``."""

    test: str
    what: str


@dataclass(frozen=True)
class Refused:
    """The refusal a request with the field set gets: gRPC ``code`` and a
    ``needle`` in the message. ``value`` sets the field on the request (None:
    any value other than the default); ``whole``: every field under this
    path is refused the same way (each is tried). ``owner``: the branch
    that will give the field an effect, if one is in flight."""

    code: str
    needle: str
    value: Callable[[Message], None] | None = None
    whole: bool = False
    owner: str = ""


@dataclass(frozen=True)
class Pending:
    """Accepted and without an effect today (``today`` says what happens);
    allowed only while ``owner``, a branch in flight that gives it its
    meaning, is not merged."""

    owner: str
    today: str


Row = Here | Elsewhere | Refused | Pending


def _public(d: Descriptor | None) -> bool:
    return (
        d is not None and not d.GetOptions().map_entry and d.full_name.startswith(PUBLIC_PACKAGES)
    )


def request_methods() -> list[MethodDescriptor]:
    return list(SERVICE.methods)


def field_paths(whole: Collection[str] = ()) -> list[str]:
    """Every field path of every request message; a path in ``whole`` is
    listed and not walked into (a request message's own name included)."""
    out: list[str] = []
    for method in request_methods():
        root = method.input_type
        if root.name in whole:
            out.append(root.name)
            continue
        out.extend(_walk(root, root.name, whole))
    return list(dict.fromkeys(out))


def leaf_paths(prefix: str) -> list[str]:
    """Every field path under ``prefix`` (a message field or a request
    message), walking into every public message."""
    root_name, *rest = prefix.split(".")
    root = next(m.input_type for m in request_methods() if m.input_type.name == root_name)
    d, path = root, root_name
    for name in rest:
        f = d.fields_by_name[name]
        path = f"{path}.{name}"
        if not _public(f.message_type):
            return [path]
        d = f.message_type
    return list(_walk(d, path, ()))


def _walk(d: Descriptor, prefix: str, whole: Collection[str]) -> Iterator[str]:
    for f in d.fields:
        path = f"{prefix}.{f.name}"
        if path in whole or not _public(f.message_type):
            yield path
        else:
            yield from _walk(f.message_type, path, whole)


def method_of(path: str) -> MethodDescriptor:
    root = path.split(".")[0]
    return next(m for m in request_methods() if m.input_type.name == root)


def set_any(request: Message, path: str) -> None:
    """Give the field at ``path`` (below the request) a value other than its
    default: what a refusal of "any value" is tried with."""
    msg = request
    names = path.split(".")[1:]
    for name in names[:-1]:
        repeated = msg.DESCRIPTOR.fields_by_name[name].is_repeated
        msg = getattr(msg, name).add() if repeated else getattr(msg, name)
    _set_field(msg, msg.DESCRIPTOR.fields_by_name[names[-1]])


def _scalar(f: FieldDescriptor) -> object:
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return "x"
    if t == FieldDescriptor.TYPE_BYTES:
        return b"x"
    if t == FieldDescriptor.TYPE_BOOL:
        return True
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 0.5
    return 1  # integers and enums


def _set_field(msg: Message, f: FieldDescriptor) -> None:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_f, value_f = (
            f.message_type.fields_by_name["key"],
            f.message_type.fields_by_name["value"],
        )
        target = getattr(msg, f.name)
        if value_f.message_type is None:
            target[_scalar(key_f)] = _scalar(value_f)
        else:
            _fill(target[_scalar(key_f)])
    elif f.message_type is not None:
        target = getattr(msg, f.name).add() if f.is_repeated else getattr(msg, f.name)
        _fill(target)
    elif f.is_repeated:
        getattr(msg, f.name).append(_scalar(f))
    else:
        setattr(msg, f.name, _scalar(f))


def _fill(msg: Message) -> None:
    """A message with its first field set (so it is present and non-empty)."""
    _set_field(msg, msg.DESCRIPTOR.fields[0])
