"""What Shoal's parts agree on: one place for every shared name and shape.

* :mod:`~shoal.contracts.names`: partitions, subjects, stream names, headers, etcd keys,
  the CRD's coordinates, annotations, the time format.
* :mod:`~shoal.contracts.spec`: the ConsumerGroup spec and every default it has (the CRD's
  schema is tested against it).
* :mod:`~shoal.contracts.events`: the assignment-log event the leader publishes and
  analytics reads.
* :mod:`~shoal.contracts.values`: the JSON values in etcd that one process writes and
  another reads (the leader's targets, the autoscaler's scale record).

These modules need only pydantic and the standard library: the consumer, the operator and
analytics all import them, and they import none of those.
"""
