"""Generate the device plugin API's Python modules from ``nodeagent/k8s/v1beta1/api.proto``.

    python scripts/gen_k8s_api.py            # rewrite nodeagent/k8s/v1beta1/api_pb2.py
    python scripts/gen_k8s_api.py --out DIR  # write them under DIR instead (the test compares)

Needs grpcio-tools (in the ``dev`` extra), which brings its own protoc; running the
plugin needs only grpcio and protobuf. The services are served and called through
``api_grpc``, which reads them from the descriptor, so no service module is generated.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = os.path.join("nodeagent", "k8s", "v1beta1", "api.proto")


def generate(out_dir: str = REPO) -> str:
    """Write ``api_pb2.py`` under ``out_dir``/nodeagent/k8s/v1beta1; its path."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("gen_k8s_api: error: grpcio-tools is not installed "
                         "(pip install grpcio-tools, or the dev extra)") from None
    os.makedirs(os.path.join(out_dir, os.path.dirname(PROTO)), exist_ok=True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")  # well-known types, unused today
    code = protoc.main(["grpc_tools.protoc", f"--proto_path={REPO}", f"--proto_path={include}",
                        f"--python_out={out_dir}", os.path.join(REPO, PROTO)])
    if code != 0:
        raise SystemExit(f"gen_k8s_api: error: protoc failed on {PROTO} (exit {code})")
    return os.path.join(out_dir, os.path.dirname(PROTO), "api_pb2.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gen_k8s_api.py", allow_abbrev=False,
                                     description="Generate the kubelet device plugin API's Python modules.")
    parser.add_argument("--out", default=REPO, metavar="DIR",
                        help="root to write nodeagent/k8s/v1beta1/api_pb2.py under (default: this repository)")
    args = parser.parse_args(argv)
    print(f"wrote {generate(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
