"""Our own ``.proto`` files for the kubelet APIs, and the Python modules generated from them.

Why: the device plugin speaks kubelet's device-plugin API (``v1beta1``) and reads its
PodResources API (``v1``) over gRPC on unix sockets. We describe both wire protocols in our own
``.proto`` files (``deviceplugin/v1beta1/api.proto``, ``podresources/v1/api.proto``); wire
compatibility rests only on the package, service and method names and field numbers.

Never hand-edit the generated ``api_pb2*.py``/``.pyi`` modules: change the ``.proto`` file and
regenerate them all with ``python -m bettercompute.proto.generate`` (a test fails when they are
stale). This package imports nothing else of ours and holds no logic.
"""
