"""Better Compute for Kubernetes: GPU reservations decided by policy and placed on real devices.

The package is layered (see the import-linter contracts in ``pyproject.toml``):
``core`` is pure, ``store`` and ``iam`` do I/O beside each other, ``service`` wires them into the
use cases the doors (HTTP API, CLI, operator) call.
"""

__version__ = "0.1.0"
