"""gRPC glue for the device plugin API, derived from the service descriptors in ``api_pb2``.

In place of grpc_tools' generated ``api_pb2_grpc.py``: a servicer is any object with the
service's methods, registered through grpc's generic handlers; a stub gets one callable per
method. The plugin serves ``DevicePlugin`` and calls ``Registration`` (the fake kubelet in the
tests does the reverse).
"""

from __future__ import annotations

import grpc

from nodeagent.k8s.v1beta1 import api_pb2


def _methods(service: str):
    """(name, full path, request class, response class, server streaming) of each method."""
    descriptor = api_pb2.DESCRIPTOR.services_by_name[service]
    for method in descriptor.methods:
        yield (method.name, f"/{descriptor.full_name}/{method.name}", getattr(api_pb2, method.input_type.name),
               getattr(api_pb2, method.output_type.name), method.server_streaming)


def add_servicer(server: grpc.Server, service: str, servicer: object) -> None:
    """Serve ``service`` ("DevicePlugin", "Registration") on ``server`` with ``servicer``'s methods."""
    handlers = {}
    for name, _path, request, response, streaming in _methods(service):
        handler = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = handler(getattr(servicer, name), request_deserializer=request.FromString,
                                 response_serializer=response.SerializeToString)
    full_name = api_pb2.DESCRIPTOR.services_by_name[service].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(full_name, handlers),))


class Stub:
    """A client of ``service`` over ``channel``: ``Stub(channel, "Registration").Register(request)``."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        for name, path, request, response, streaming in _methods(service):
            call = channel.unary_stream if streaming else channel.unary_unary
            setattr(self, name, call(path, request_serializer=request.SerializeToString,
                                     response_deserializer=response.FromString))
