"""A consumer group, as its members, the operator and analytics all handle it.

* :mod:`~shoal.group.config`: a member's configuration, derived from the spec and
  rendered to (and read from) the pod environment;
* :mod:`~shoal.group.jetstream`: the group's stream, durables, dead-letter and log streams;
* :mod:`~shoal.group.view`: the local mirror of the group's etcd keys;
* :mod:`~shoal.group.status`: what ``shoal-consumer status`` and the operator report;
* :mod:`~shoal.group.pause`: pausing and resuming the group (its ``paused`` key);
* :mod:`~shoal.group.problems`: a member's NATS refusal, reported in etcd;
* :mod:`~shoal.group.handlerref`: importing the handler a spec names.

It imports only the contracts, the modules beside them and the clients
(scripts/check_imports.py).
"""
