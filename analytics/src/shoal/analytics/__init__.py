"""Assignment-log export and the PySpark skew and churn report.

Modules (one concept each):

* ``events``: the versioned event model the leader publishes (pydantic + stdlib only; the
  consumer runtime imports it).
* ``layout``: date-partitioned part files, and which files readers take, in which order.
* ``export``: JetStream log stream -> files (``shoal-analytics export``).
* ``ingest``: lines -> flat rows (events or problems), shared by both report engines.
* ``metrics``: the per-generation metric definitions as pure functions.
* ``tables``: the report's tables and their columns, the engines' common contract.
* ``spark_job`` / ``session``: the PySpark engine and its session (``spark-submit`` entry).
* ``oracle``: the pandas engine, the Spark job's test oracle.
* ``report``, ``plots``, ``html_report``: summary.json, tables, PNG plots, report.html.
* ``generate``: synthetic histories (both strategies) and hand-written corner cases.
* ``cli``: ``shoal-analytics export | report | generate``.
"""
