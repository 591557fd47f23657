"""The local control plane, real server processes and the end-to-end suite."""
