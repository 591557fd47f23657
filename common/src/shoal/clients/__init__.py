"""The clients every Shoal part uses, apart from any one of them.

* :mod:`~shoal.clients.etcd`: etcd, with fail-over across endpoints, TLS and auth, and
  watches that notice silence; :mod:`~shoal.clients.backoff` its retry pacing;
* :mod:`~shoal.clients.nats`: the NATS connection (retries, one-line refusals, health),
  :mod:`~shoal.clients.natsauth` its TLS and credentials, and
  :mod:`~shoal.clients.natsclient` the member's lean read path on nats-py;
* :mod:`~shoal.clients.kube`: the Kubernetes API client.

They import nothing of Shoal but the contracts (scripts/check_imports.py), so the
consumer, the operator and analytics all use them without importing one another.
"""
