"""Assignment-log export and the PySpark report (see the analytics issue)."""
