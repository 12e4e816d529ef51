"""A real Kubernetes control plane on loopback, for ``better-compute dev --kube`` and the tests.

Why it exists: a newcomer should be able to ``kubectl apply`` a Reservation against a real
API server on a laptop, and our tests must meet the real API server, authorizers, admission
chain and scheduler before a platform team's first install does. Both run the same code,
which is here (the product may not import ``tests/``):

- ``binary``: where the one binary (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler and kubectl, built from Kubernetes' Go modules by
  ``python -m tests.controlplane.build``) is, or one clear error saying how to build it;
- ``pki``: the cluster's CA and certificates;
- ``plane``: ``ControlPlane``, the processes started and stopped, and plain calls as the
  admin or any identity;
- ``chart``: the Helm chart's CRDs, RBAC and webhook configurations installed as ``helm
  install`` would, with the webhooks pointed at the operator on 127.0.0.1;
- ``nodes``: Node objects written as a kubelet writes them, with its own credentials.

What it must never do: download anything, listen beyond 127.0.0.1, or leave a process
running after it is stopped.
"""
