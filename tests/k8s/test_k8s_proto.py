"""The device plugin API as the kubelet speaks it: the shipped .proto's services, messages and
field numbers against the published v1beta1 API (written out here by hand, so that an edit to
the .proto cannot pass unnoticed), and the shipped generated module against the .proto."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

pytest.importorskip("google.protobuf", reason="the k8s extra (protobuf) is not installed")
pytest.importorskip("grpc", reason="the k8s extra (grpcio) is not installed")

from google.protobuf.descriptor import FieldDescriptor as F  # noqa: E402

from nodeagent.k8s.v1beta1 import api_pb2 as api  # noqa: E402

_GEN_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gen_k8s_api.py")
_spec = importlib.util.spec_from_file_location("gen_k8s_api", _GEN_PATH)
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

STR, BOOL, INT32, INT64, MSG = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_MESSAGE
ONE, MANY = "one", "many"

# k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1: message -> field -> (number, type, repeated?, message type)
PUBLISHED = {
    "DevicePluginOptions": {"pre_start_required": (1, BOOL, ONE, None),
                            "get_preferred_allocation_available": (2, BOOL, ONE, None)},
    "RegisterRequest": {"version": (1, STR, ONE, None), "endpoint": (2, STR, ONE, None),
                        "resource_name": (3, STR, ONE, None),
                        "options": (4, MSG, ONE, "v1beta1.DevicePluginOptions")},
    "Empty": {},
    "ListAndWatchResponse": {"devices": (1, MSG, MANY, "v1beta1.Device")},
    "TopologyInfo": {"nodes": (1, MSG, MANY, "v1beta1.NUMANode")},
    "NUMANode": {"ID": (1, INT64, ONE, None)},
    "Device": {"ID": (1, STR, ONE, None), "health": (2, STR, ONE, None),
               "topology": (3, MSG, ONE, "v1beta1.TopologyInfo")},
    "PreStartContainerRequest": {"devices_ids": (1, STR, MANY, None)},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {
        "container_requests": (1, MSG, MANY, "v1beta1.ContainerPreferredAllocationRequest")},
    "ContainerPreferredAllocationRequest": {"available_deviceIDs": (1, STR, MANY, None),
                                            "must_include_deviceIDs": (2, STR, MANY, None),
                                            "allocation_size": (3, INT32, ONE, None)},
    "PreferredAllocationResponse": {
        "container_responses": (1, MSG, MANY, "v1beta1.ContainerPreferredAllocationResponse")},
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, STR, MANY, None)},
    "AllocateRequest": {"container_requests": (1, MSG, MANY, "v1beta1.ContainerAllocateRequest")},
    "ContainerAllocateRequest": {"devices_ids": (1, STR, MANY, None)},
    "CDIDevice": {"name": (1, STR, ONE, None)},
    "AllocateResponse": {"container_responses": (1, MSG, MANY, "v1beta1.ContainerAllocateResponse")},
    "ContainerAllocateResponse": {"envs": (1, MSG, MANY, "v1beta1.ContainerAllocateResponse.EnvsEntry"),
                                  "mounts": (2, MSG, MANY, "v1beta1.Mount"),
                                  "devices": (3, MSG, MANY, "v1beta1.DeviceSpec"),
                                  "annotations": (4, MSG, MANY, "v1beta1.ContainerAllocateResponse.AnnotationsEntry"),
                                  "cdi_devices": (5, MSG, MANY, "v1beta1.CDIDevice")},
    "Mount": {"container_path": (1, STR, ONE, None), "host_path": (2, STR, ONE, None),
              "read_only": (3, BOOL, ONE, None)},
    "DeviceSpec": {"container_path": (1, STR, ONE, None), "host_path": (2, STR, ONE, None),
                   "permissions": (3, STR, ONE, None)},
}

# service -> method -> (input, output, server streaming?)
SERVICES = {
    "Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}


def test_the_messages_are_the_published_api_field_for_field():
    file = api.DESCRIPTOR
    assert file.package == "v1beta1"
    assert not file.message_types_by_name["RegisterRequest"].fields_by_name["version"].has_presence  # proto3
    assert set(file.message_types_by_name) == set(PUBLISHED)
    for name, fields in PUBLISHED.items():
        message = file.message_types_by_name[name]
        got = {}
        for f in message.fields:
            is_repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED
            repeated = MANY if is_repeated else ONE
            got[f.name] = (f.number, f.type, repeated, f.message_type.full_name if f.message_type else None)
        assert got == fields, name
    envs = file.message_types_by_name["ContainerAllocateResponse"].fields_by_name["envs"].message_type
    assert envs.GetOptions().map_entry and [f.type for f in envs.fields] == [STR, STR]


def test_the_services_are_the_published_api_method_for_method():
    assert set(api.DESCRIPTOR.services_by_name) == set(SERVICES)
    for name, methods in SERVICES.items():
        service = api.DESCRIPTOR.services_by_name[name]
        assert service.full_name == f"v1beta1.{name}"  # what the kubelet puts in its paths
        got = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods}
        assert got == methods
        assert not any(m.client_streaming for m in service.methods)


def _serialized_descriptor(path: str) -> bytes:
    """The bytes handed to AddSerializedFile in a generated ``_pb2.py``."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"no AddSerializedFile call in {path}")


def test_the_shipped_module_is_what_the_proto_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) is not installed: cannot regenerate")
    fresh_pb2 = gen.generate(str(tmp_path))
    shipped = os.path.join(gen.REPO, "nodeagent", "k8s", "v1beta1")
    assert _serialized_descriptor(fresh_pb2) == _serialized_descriptor(os.path.join(shipped, "api_pb2.py")), \
        "api_pb2.py is stale: run python scripts/gen_k8s_api.py"
