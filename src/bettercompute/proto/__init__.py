"""Our own ``.proto`` files for the kubelet APIs, and the Python modules generated from them.

Why: the node agent speaks the kubelet's device-plugin API (``v1beta1``), reads its PodResources
API (``v1``), serves its DRA plugin API (``v1`` and ``v1beta1``) and the plugin watcher's
``Registration`` service, all over gRPC on unix sockets. We describe these wire protocols in our
own ``.proto`` files (``deviceplugin/v1beta1``, ``podresources/v1``, ``dra/v1``, ``dra/v1beta1``,
``pluginregistration/v1``, each an ``api.proto``; distinct import paths, so Python's default
descriptor pool never sees two files of one name); wire compatibility rests only on the package,
service and method names and field numbers.

Never hand-edit the generated ``api_pb2*.py``/``.pyi`` modules: change the ``.proto`` file and
regenerate them all with ``python -m bettercompute.proto.generate`` (a test fails when they are
stale). This package imports nothing else of ours and holds no logic.
"""
