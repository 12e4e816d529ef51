"""``kubectl bcd``: the kubectl plugin for Reservations, GPUPools and GPUQuotas.

Why a package of its own: people who already hold a kubeconfig should reserve GPUs the way they
use the rest of their cluster: with their own identity and RBAC, against the API server, with
no port-forward to the HTTP API and no API token. The plugin writes and reads the project's
custom resources (``bcd.dev/v1alpha1``) through ``kube.client.KubeClient``; the operator does
the rest, exactly as for a ``kubectl apply``. Modules:

- ``app``: the typer commands and ``main`` (the ``kubectl-bcd`` console script);
- ``specs``: pure: options to a Reservation, what a Reservation's status says (ready, refused,
  ended), and a failed API call as one line that names the object;
- ``times``: pure: RFC 3339 times and durations as options take them and tables show them;
- ``tables``: pure: the rich tables each command prints.

What this package must never do: import ``store``, ``service``, ``operator``, ``api``, ``cli``
or ``dev`` (it is a Kubernetes client; import-linter checks it), stamp who asked (the admission
webhook does), decide what the operator decides, or show a Python traceback to a user.
"""
