"""The Kubernetes device plugin (``nodeagent k8s-device-plugin``): the daemon's devices
offered to the kubelet as shares. :mod:`.shares` decides (pure), :mod:`.watch` keeps the
daemon's view, :mod:`.plugin` speaks to the kubelet (gRPC, device plugin API v1beta1 in
:mod:`.v1beta1`), :mod:`.cli` is the command. Needs the ``k8s`` extra (grpcio, protobuf)."""
